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
    if plan.cfg.cluster.scheduler is Scheduler.local:
        from hpcrl.local import run_local

        run_local(plan)
        return 0
    print(f"plan ok: {plan.cfg.model.name} on {plan.cfg.cluster.name}, {plan.topology.nodes} node(s)")
    print("hpcrl submit: submission to Slurm is not built yet (issue 3); `hpcrl render` writes the script")
    return 1


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


COMMANDS = {"plan": cmd_plan, "render": cmd_render, "submit": cmd_submit, "show": cmd_show}

if __name__ == "__main__":
    started = time.perf_counter()
    sys.exit(main())
