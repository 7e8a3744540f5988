"""``hpcrl`` command line: thin wrappers over plan / render / submit.

Only light modules are imported at start-up: planning and rendering must stay well under a
second and must not import torch, ray or vllm.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from hpcrl.errors import HpcrlError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpcrl",
        description="GRPO/DAPO post-training on Slurm. Overrides use Hydra syntax: "
        "+cluster=gb200 +model=nemotron_super trainer.tp=2 ...",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("plan", "compose and validate the config, print the topology/memory plan"),
        ("render", "write the sbatch script and resolved config that submit would use, without submitting"),
        ("submit", "validate, then run locally (no cluster) or submit to Slurm"),
        ("show", "print the composed config as YAML"),
    ):
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. +cluster=gb200 trainer.tp=2")
        if name == "render":
            p.add_argument(
                "--out", type=Path, default=None, help="directory to write into (default: the run directory)"
            )
        if name == "submit":
            p.add_argument(
                "--hold", type=float, default=0.0, metavar="SECONDS",
                help="Slurm: keep the job's Ray cluster up this long after the driver (debugging)",
            )  # fmt: skip
            p.add_argument(
                "--smoke", action="store_true",
                help="Slurm: only bring up Ray and place one actor per node by role (checks an allocation; no training)",
            )  # fmt: skip
    for name, text in (
        ("status", "state of a job (or of the recent ones)"),
        ("logs", "per-node logs of a job"),
        ("cancel", "cancel a job"),
        ("ls", "recent runs with state, nodes and start time"),
    ):
        p = sub.add_parser(name, help=text, description=text)
        if name in ("status", "logs", "cancel"):
            p.add_argument("job", nargs="?" if name == "status" else None)
        if name == "logs":
            p.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
        p.add_argument(
            "--root", type=Path, default=Path("runs"), help="run.output_root of the runs (default: runs)"
        )
    show = sub.choices["show"]
    show.add_argument("--groups", action="store_true", help="list the options of every config group")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except HpcrlError as exc:
        print(f"hpcrl: error: {exc}", file=sys.stderr)
        return 2


def cmd_plan(args: argparse.Namespace) -> int:
    from rich.console import Console

    from hpcrl.plan import plan_from_overrides
    from hpcrl.view import show_plan

    plan = plan_from_overrides(args.overrides)
    show_plan(plan, Console())
    return 0 if plan.memory.fits else 1


def cmd_render(args: argparse.Namespace) -> int:
    from hpcrl.cluster import Scheduler
    from hpcrl.plan import plan_from_overrides
    from hpcrl.rundir import new_run_dir, write_resolved_config

    plan = plan_from_overrides(args.overrides)
    plan.require_fit()
    run_dir = args.out or new_run_dir(plan.cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = write_resolved_config(plan.cfg, run_dir)
    print(f"config  {config_path}")
    if plan.cfg.cluster.scheduler is Scheduler.slurm:
        from hpcrl.launch.sbatch import render_sbatch

        script = run_dir / "sbatch.sh"
        script.write_text(render_sbatch(plan, run_dir.resolve()))
        print(f"sbatch  {script}")
    else:
        print("cluster=local runs without Slurm: there is no sbatch script (`hpcrl submit` runs it here)")
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    from hpcrl.cluster import Scheduler
    from hpcrl.plan import plan_from_overrides

    plan = plan_from_overrides(args.overrides)
    plan.require_fit()
    plan.require_buildable()
    if plan.cfg.cluster.scheduler is Scheduler.local:
        from hpcrl.local import run_local

        run_local(plan)
        return 0
    from hpcrl.launch.submit import submit

    done = submit(plan, hold_s=args.hold, smoke=args.smoke)
    print(f"job     {done.job_id}  ({plan.topology.nodes} node(s) on {plan.cfg.cluster.name})")
    print(f"run dir {done.run_dir}")
    for path in done.logs:
        print(f"log     {path}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    if args.groups:
        from hpcrl.config import GROUPS, conf_dir

        for group in GROUPS:
            names = sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))
            print(f"{group}: {', '.join(names)}")
        return 0
    from omegaconf import OmegaConf

    from hpcrl.config import compose_raw

    print(OmegaConf.to_yaml(compose_raw(args.overrides)), end="")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from hpcrl.launch import lifecycle

    if args.job is None:
        return cmd_ls(args)
    job = lifecycle.info(args.job, args.root)
    print(f"{job.job_id}  {job.state}  {job.name}  {job.nodes} node(s)  {job.run_dir}")
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    from hpcrl.launch import lifecycle

    jobs = lifecycle.recent(args.root)
    if not jobs:
        print(f"no Slurm runs under {args.root}/")
    for job in jobs:
        started = time.strftime("%Y-%m-%d %H:%M", time.localtime(job.submitted))
        print(
            f"{job.job_id:>8}  {job.state:<24} {job.nodes:>3} node(s)  {started}  {job.name}  {job.run_dir}"
        )
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    from hpcrl.launch import lifecycle

    job = lifecycle.info(args.job, args.root)
    if args.follow:
        lifecycle.wait(job.job_id, job.run_dir, timeout_s=7 * 24 * 3600)
    for path in lifecycle.log_paths(job):
        print(f"==> {path} <==")
        print(path.read_text() if path.exists() else "(not written yet)")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    from hpcrl.launch import lifecycle

    job = lifecycle.info(args.job, args.root)
    lifecycle.cancel(job.job_id)
    print(f"cancelled {job.job_id} ({job.run_dir})")
    return 0


COMMANDS = {"plan": cmd_plan, "render": cmd_render, "submit": cmd_submit, "show": cmd_show, "status": cmd_status,
            "logs": cmd_logs, "cancel": cmd_cancel, "ls": cmd_ls}  # fmt: skip

if __name__ == "__main__":
    sys.exit(main())
