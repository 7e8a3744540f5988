"""Where ``hpcrl doctor`` runs: on this machine, or on every node of a running job from the login node
(one task a node through ``srun --overlap``, in the job's container, over every component of a
heterogeneous job). Each node's task checks the plan's expectations as its own node's (``SLURM_NODEID``):
its role's GPUs, none on an environment node. The checks: ``doctor.py``."""

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
    if expect_json is not None:  # a node of a fan-out: the login node's expectations, as its role's
        node = int(os.environ.get("SLURM_NODEID", "0"))  # global over a heterogeneous job's components
        return 0 if report(Expect.from_json(expect_json).on_node(node)) else 1
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
    python = cfg.cluster.python or sys.executable
    command = [python, "-m", "hpcrl.cli", "doctor", "--expect", expect.to_json()]
    argv = doctor_srun(job, job_components(job), container, command)
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


def doctor_srun(job: str, parts: list[int], container: list[str], command: list[str]) -> list[str]:
    """srun's command line for one ``command`` task on every node of ``job``, whose components hold
    ``parts`` nodes each (one: a homogeneous job): each component its own counts, ':' between them, so
    srun from outside the allocation starts a task on each node of each (else one task in the first)."""
    argv = ["srun", f"--jobid={job}", "--overlap", "--kill-on-bad-exit=0", *container]
    for i, nodes in enumerate(parts):
        argv += [":"] if i else []
        argv += [f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", *command]
    return argv


def job_components(job: str) -> list[int]:
    """The nodes of each component of the running ``job`` in component order (a heterogeneous job's
    are ``JOB+0``, ``JOB+1`` ...; a homogeneous job has one)."""
    from hpcrl.config.slurminfo import run_slurm
    from hpcrl.errors import HpcrlError

    rows = [line.split() for line in run_slurm(["squeue", "-h", "-j", job, "-o", "%i %D %T"]).splitlines()]
    rows = sorted((r for r in rows if len(r) == 3), key=lambda r: int(r[0].partition("+")[2] or 0))
    states = {r[2] for r in rows}
    if states != {"RUNNING"}:
        state = ", ".join(sorted(states)) or "not in squeue"
        raise HpcrlError(
            f"hpcrl doctor --job {job}: the job is not running ({state}); pass a running job or allocation"
        )
    return [int(r[1]) for r in rows]
