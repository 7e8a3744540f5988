"""``hpcrl`` command line: thin wrappers over plan / render / submit.

Only light modules are imported at start-up: planning and rendering must stay well under a
second and must not import torch, ray or vllm.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from hpcrl.errors import HpcrlError
from hpcrl.launch import cli_options as opts

Options = Callable[[argparse.ArgumentParser], None]

PLANNED: dict[str, tuple[str, Options | None]] = {
    "plan": ("compose and validate the config, print the topology/memory plan", None),
    "render": (
        "write the sbatch script and resolved config that submit would use, without submitting",
        opts.add_render,
    ),
    "submit": ("validate, then run locally (no cluster) or submit to Slurm or Kubernetes", opts.add_submit),
    "show": ("print the composed config as YAML", opts.add_show),
    "debug": (
        "hold an allocation with the planned nodes and its Ray cluster up; prints how to attach",
        opts.add_debug,
    ),
    "run": ("run the driver against a held debug session's Ray cluster (no restart)", opts.add_run),
    "doctor": ("check this node, or every node of a job, against what the plan needs", opts.add_doctor),
    "fetch": (
        "download the model and hf: data sets a config needs into the site's Hugging Face cache (login node)",
        None,
    ),
}
"""Commands that compose a config from Hydra overrides, with their own options."""

JOBS: dict[str, tuple[str, Options]] = {
    "status": ("state of a job (or of the recent ones)", opts.add_job(optional=True)),
    "logs": ("per-node logs of a job", opts.add_logs),
    "cancel": ("cancel a job", opts.add_job(optional=False)),
    "ls": ("recent runs with state, nodes and start time", opts.add_ls),
    "attach": ("open a shell (or run a command after --) on a node of a held debug session", opts.add_attach),
}
"""Commands about submitted jobs and their run directories (all take ``--root``)."""


TOOLS: dict[str, tuple[str, Options]] = {
    "init": ("write a starter site.yaml (reads sinfo/scontrol where Slurm is installed)", opts.add_init),
    "export": (
        "write a checkpoint as a Hugging Face model directory (streamed; no GPU needed)",
        opts.add_export,
    ),
    "eval": ("pass@1 (greedy), pass@k and maj@k of a model on a data set; --compare base", opts.add_eval),
    "plot": ("curves.png and a self-contained curves.html of one or more runs' metrics", opts.add_plot),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpcrl",
        description="GRPO/DAPO post-training on Slurm. Overrides use Hydra syntax: "
        "+cluster=gb200 +model=nemotron_super trainer.tp=2 ...",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (text, options) in PLANNED.items():
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. +cluster=gb200 trainer.tp=2")
        if options:
            options(p)
    for name, (text, job_options) in JOBS.items():
        p = sub.add_parser(name, help=text, description=text)
        job_options(p)
        p.add_argument(
            "--root", type=Path, default=Path("runs"), help="run.output_root of the runs (default: runs)"
        )
    for name, (text, tool_options) in TOOLS.items():
        tool_options(sub.add_parser(name, help=text, description=text))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if argv[:1] == ["attach"] and "--" in argv:  # everything after -- is the command to run there
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1 :]
    args = _parser().parse_args(argv)
    args.cmd = command
    try:
        return COMMANDS[args.command](args)
    except HpcrlError as exc:
        print(f"hpcrl: error: {exc}", file=sys.stderr)
        return 2


def cmd_plan(args: argparse.Namespace) -> int:
    from rich.console import Console

    from hpcrl.config.cluster import Scheduler
    from hpcrl.plan.planner import plan_from_overrides
    from hpcrl.plan.show import show_plan

    plan = plan_from_overrides(args.overrides)
    sbatch = None
    if plan.cfg.cluster.scheduler is Scheduler.slurm:
        from hpcrl.launch.sbatch import slurm_parameters

        sbatch = slurm_parameters(plan)
    show_plan(plan, Console(), sbatch)
    from hpcrl.launch.gate import require_submittable

    require_submittable(plan, ask_slurm=True)  # after the tables: they help to fix what submit refuses
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    from hpcrl.config.cluster import Scheduler
    from hpcrl.plan.planner import plan_from_overrides
    from hpcrl.run.rundir import new_run_dir, write_resolved_config

    if args.multirun:
        from hpcrl.tools.sweep import preview_multirun

        return preview_multirun(args.overrides)
    from hpcrl.launch.gate import require_submittable

    plan = plan_from_overrides(args.overrides)
    run_dir = args.out or new_run_dir(plan.cfg)
    require_submittable(plan, run_dir, ask_slurm=True)  # a script submit or Slurm refuses is not written
    if plan.search:
        print(plan.search.summary())
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = write_resolved_config(plan.cfg, run_dir)
    print(f"config  {config_path}")
    if plan.cfg.cluster.scheduler is Scheduler.slurm:
        from hpcrl.launch.sbatch import render_sbatch

        script = run_dir / "sbatch.sh"
        script.write_text(render_sbatch(plan, run_dir.resolve()))
        print(f"sbatch  {script}")
    elif plan.cfg.cluster.scheduler is Scheduler.kuberay:
        from hpcrl.launch.kuberay import manifest_yaml, pods_run_dir, rayjob

        manifest = run_dir / "rayjob.yaml"
        manifest.write_text(manifest_yaml(rayjob(plan, pods_run_dir(plan, run_dir))))
        print(f"rayjob  {manifest}")
    else:
        print("cluster=local runs without Slurm: there is no sbatch script (`hpcrl submit` runs it here)")
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    from hpcrl.config.cluster import Scheduler
    from hpcrl.launch.gate import require_submittable
    from hpcrl.plan.planner import plan_from_overrides
    from hpcrl.plan.show import header, recipe_line

    if args.multirun:
        from hpcrl.tools.sweep import preview_multirun, submit_multirun

        return (
            preview_multirun(args.overrides) if args.dry_run else submit_multirun(args.overrides, args.into)
        )
    if args.dry_run:
        raise HpcrlError("--dry-run is for sweeps (submit -m); `hpcrl render` shows one run's files")
    plan = plan_from_overrides(args.overrides)
    require_submittable(plan)
    print(header(plan.cfg))
    if line := recipe_line(plan.cfg):
        print(line)
    if plan.search:
        print(plan.search.summary())
    if plan.cfg.cluster.scheduler is Scheduler.local:
        from hpcrl.launch.local import run_local

        def local() -> int:
            run_local(plan)
            return 0

        return _stoppable(local)
    from hpcrl.launch.submit import submit

    done = submit(plan, hold_s=args.hold, smoke=args.smoke)  # sbatch, or a RayJob (launch/kube_jobs.py)
    print(f"job     {done.job_id}  ({plan.job_nodes} node(s) on {plan.cfg.cluster.name})")
    print(f"run dir {done.run_dir}")
    for path in done.logs:
        print(f"log     {path}")
    return 0


def _stoppable(drive: Callable[[], int]) -> int:
    """A driver in this shell: a saved stop (``run/preempt.py``) and a second Ctrl-C each end in one
    line and their exit code, without a traceback."""
    from hpcrl.run.preempt import EXIT_CODES, Preempted

    try:
        return drive()
    except Preempted as stop:
        print(f"hpcrl: {stop}; to resume, run again with {stop.resume}", file=sys.stderr)
        return stop.exit_code
    except KeyboardInterrupt:
        print("hpcrl: stopped by a second Ctrl-C, without saving the step in progress", file=sys.stderr)
        return EXIT_CODES[signal.SIGINT]


def cmd_fetch(args: argparse.Namespace) -> int:
    from hpcrl.config.compose import compose_config
    from hpcrl.tools.fetch import fetch_all

    cfg = compose_config(args.overrides)
    for item in fetch_all(cfg, say=lambda line: print(f"hpcrl fetch: {line}", flush=True)):
        print(item.line())
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from hpcrl.config.compose import show_text

    print(show_text(args.overrides, args.groups), end="")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from hpcrl.tools.doctor_run import doctor_command

    return doctor_command(args.overrides, job=args.job, here=args.here, expect_json=args.expect)


def cmd_status(args: argparse.Namespace) -> int:
    from hpcrl.launch import lifecycle

    if args.job is None:
        return cmd_ls(args)
    job = lifecycle.info(args.job, args.root)
    print(f"{job.job_id}  {job.state}  {job.name}  {job.nodes} node(s)  {job.run_dir}")
    return 0


def cmd_debug(args: argparse.Namespace) -> int:
    import os

    from hpcrl.config.cluster import Scheduler
    from hpcrl.launch.debug import READY_TIMEOUT_S, node_hosts, wait_ready
    from hpcrl.plan.planner import plan_from_overrides

    if args.here:
        from hpcrl.launch import here

        here.require_allocation(os.environ)  # first: outside an allocation nothing else matters
    plan = plan_from_overrides(args.overrides)
    plan.require_fit()
    if plan.cfg.cluster.scheduler is Scheduler.local:
        raise HpcrlError("hpcrl debug holds a Slurm allocation; choose a Slurm cluster (cluster=...)")
    if plan.cfg.cluster.scheduler is Scheduler.kuberay:
        from hpcrl.launch.kube_jobs import debug_session

        return debug_session(plan, here=args.here)
    from hpcrl.launch.gate import require_submittable

    require_submittable(plan)  # what submit refuses a debug session refuses too (one code path)
    ended, stop, held = None, None, "held until the time limit"
    if args.here:
        alloc = here.allocation(os.environ)
        here.check_fits(plan, alloc)
        here.check_free(alloc.job_id, Path(plan.cfg.run.output_root))
        job_id = alloc.job_id
        run_dir, ended, stop = here.start_here(plan, alloc, watch_pid=os.getppid())
        where = f"debug session in your allocation, {plan.job_nodes} of its {len(alloc.hosts)} node(s)"
        held = "held until you leave this shell, the allocation ends or you stop it"
    else:
        from hpcrl.launch.submit import submit

        done = submit(plan, debug=True)
        job_id, run_dir = done.job_id, done.run_dir
        where = f"debug session, {plan.job_nodes} node(s) on {plan.cfg.cluster.name}"
    root = plan.cfg.run.output_root
    print(f"job     {job_id}  ({where})")
    print(f"run dir {run_dir}")
    if not args.no_wait:
        try:
            ready = wait_ready(
                job_id, run_dir, READY_TIMEOUT_S, lambda m: print(f"        {m}", flush=True), ended
            )
        except BaseException:
            if stop:  # nothing of a session that never came up stays in the user's allocation
                stop()
            raise
        hosts = node_hosts(run_dir, plan.job_nodes)
        print(f"ready   Ray up on {', '.join(hosts)} after {ready['seconds']:.0f}s; {held}")
    print(f"attach  hpcrl attach {job_id} --root {root}        (shell on the head node)")
    print(f"run     hpcrl run --job {job_id} --root {root} {' '.join(args.overrides)}")
    print(f"stop    hpcrl cancel {job_id} --root {root}{'   (this Ray only)' if args.here else ''}")
    return 0


def _debug_root(args: argparse.Namespace) -> Path:
    if args.root is not None:
        return Path(args.root)
    from hpcrl.config.compose import compose_config

    return Path(compose_config(list(args.overrides)).run.output_root)


def cmd_run(args: argparse.Namespace) -> int:
    import os

    from hpcrl.launch.debug import run_in_session

    job_id = args.job or os.environ.get("SLURM_JOB_ID")
    if not job_id:
        raise HpcrlError(
            "which debug session? pass --job JOB (or run inside its allocation: `hpcrl attach JOB`)"
        )
    return _stoppable(lambda: run_in_session(job_id, _debug_root(args), list(args.overrides), here=args.here))


def cmd_attach(args: argparse.Namespace) -> int:
    from hpcrl.launch.debug import attach

    return attach(args.job, args.root, args.node, args.cmd)


def cmd_ls(args: argparse.Namespace) -> int:
    from hpcrl.launch import lifecycle

    sweep = getattr(args, "sweep", None)  # `hpcrl status` without a job lands here, without --sweep
    if getattr(args, "plot", False) and sweep is None:
        raise HpcrlError("hpcrl ls --plot plots a sweep: add --sweep DIR (one run: hpcrl plot RUN_DIR)")
    if sweep is not None:
        from hpcrl.tools.sweep import print_summary

        print_summary(sweep)
        if args.plot:
            return cmd_plot(argparse.Namespace(runs=[sweep], out=None))
        return 0

    lifecycle.print_recent(args.root)
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    from hpcrl.launch import lifecycle

    job = lifecycle.info(args.job, args.root)
    if args.follow:
        lifecycle.wait(job.job_id, job.run_dir, timeout_s=7 * 24 * 3600)
    for where, text in lifecycle.log_texts(job):
        print(f"==> {where} <==")
        print(text)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    from hpcrl.launch import lifecycle

    job = lifecycle.info(args.job, args.root)
    print(f"cancelled {lifecycle.cancel(job)} ({job.run_dir})")
    return 0


def cmd_init(args: argparse.Namespace) -> int:
    from hpcrl.tools.siteinit import init_from_cli

    return init_from_cli(args.cluster, args.account, args.image, args.partition, args.force, args.hf_home)


def cmd_export(args: argparse.Namespace) -> int:
    from hpcrl.tools.export import export

    export(args.checkpoint, args.out, args.dtype)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from hpcrl.tools.evaluate import run_eval

    return run_eval(list(args.overrides), args.model, args.out, args.compare)


def cmd_plot(args: argparse.Namespace) -> int:
    from hpcrl.tools.plot import plot_runs

    for path in plot_runs(list(args.runs), args.out):
        print(path)
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    name: globals()[f"cmd_{name}"] for name in (*PLANNED, *JOBS, *TOOLS)
}
"""Each command's ``cmd_<name>`` function above."""

if __name__ == "__main__":
    sys.exit(main())
