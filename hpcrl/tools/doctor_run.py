"""Where ``hpcrl doctor`` runs: on this machine, or on every node of a running job from the login node
(one task a node through ``srun --overlap``, in the job's container). The checks: ``doctor.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hpcrl.launch.doctor import Expect, expect_from_plan, report
from hpcrl.plan.planner import Plan


def doctor_command(overrides: list[str], *, job: str | None, here: bool, expect_json: str | None) -> int:
    """``hpcrl doctor``: this node (``--here``, or outside any allocation), or every node of ``job``
    (default: the allocation you are in, ``$SLURM_JOB_ID``). Exit status 1 if any check fails."""
    if expect_json is not None:  # a node of a fan-out: the login node's expectations
        return 0 if report(Expect.from_json(expect_json)) else 1
    from hpcrl.plan.planner import plan_from_overrides

    plan = plan_from_overrides(overrides)
    job = None if here else job or os.environ.get("SLURM_JOB_ID")
    if job is None:
        return 0 if report(expect_from_plan(plan)) else 1
    return fan_out(job, plan)


def fan_out(job: str, plan: Plan) -> int:
    """One doctor task on every node of ``job`` (``srun --overlap``, in the job's container), with the
    expectations on the command line and a file on the shared filesystem each node must see."""
    import time

    from hpcrl.launch.sbatch import container_args

    cfg = plan.cfg
    shared = Path(cfg.run.output_root).resolve() / ".doctor" / f"{job}-{time.time():.0f}.json"
    shared.parent.mkdir(parents=True, exist_ok=True)
    expect = expect_from_plan(plan, shared_file=str(shared))
    shared.write_text(expect.to_json())
    # the run dir's mount too: .doctor/ sits beside the runs, under output_root
    container = container_args(cfg.cluster, run_dir=shared.parent)
    nodes = job_nodes(job)
    python = cfg.cluster.python or sys.executable
    argv = [
        "srun", f"--jobid={job}", "--overlap", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1",
        "--kill-on-bad-exit=0", *container,
        python, "-m", "hpcrl.cli", "doctor", "--expect", expect.to_json(),
    ]  # fmt: skip
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    finally:
        shared.unlink(missing_ok=True)
    lines = done.stdout.splitlines()
    print("\n".join(sorted(lines, key=lambda line: line.split()[1:2])))  # by node, srun interleaves them
    if done.returncode and "FAIL" not in done.stdout:
        said = " ".join(done.stderr.split())[-400:]
        print(
            f"FAIL  job {job}  start     srun ended with code {done.returncode} before the checks ran ({said}); "
            "fix: check the job is running, cluster.container.image starts, and hpcrl is installed in it"
        )
    return 0 if done.returncode == 0 else 1


def job_nodes(job: str) -> int:
    """How many nodes the running job holds (srun from outside the allocation would start one task)."""
    from hpcrl.config.slurminfo import run_slurm
    from hpcrl.errors import HpcrlError

    fields = run_slurm(["squeue", "-h", "-j", job, "-o", "%D %T"]).split()
    if len(fields) < 2 or fields[1] != "RUNNING":
        state = fields[1] if len(fields) > 1 else "not in squeue"
        raise HpcrlError(
            f"hpcrl doctor --job {job}: the job is not running ({state}); pass a running job or allocation"
        )
    return int(fields[0])
