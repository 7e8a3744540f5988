"""``hpcrl debug --here``: a debug session on an allocation the user already holds (``salloc``, ``srun --pty``).

Instead of submitting a job, it runs the node task an ``hpcrl debug`` job runs (``launch/job.py``: doctor,
check-in, Ray head and nodes under the reaper, the per-session token, the pinned ports) as one
``srun --overlap`` step over the plan's nodes of the allocation, and returns to the shell once Ray is up.
That step is started by ``srun.sh`` in the run directory (the site's ``cluster.setup`` and hpcrl's exports,
as the sbatch script has them, then ``srun``) under a reaper that watches the shell the command was typed
in: leaving that shell, the allocation ending, or ``hpcrl cancel`` (which stops this step only) stop Ray and
nothing else of the allocation.

    python -m hpcrl.launch.here TASK.pkl      # one node's task (what srun.sh runs on every node)
"""

from __future__ import annotations

import math
import pickle
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from hpcrl.errors import HpcrlError
from hpcrl.launch.sbatch import SUBMITIT_DIR
from hpcrl.plan.components import node_gpus
from hpcrl.plan.planner import Plan

HOLD_GRACE_S = 20.0
"""Leaving the shell: how long srun's node tasks get to stop Ray before the step is killed."""
TASK_FILE = "here_task.pkl"


@dataclass(frozen=True)
class Allocation:
    job_id: str
    hosts: tuple[str, ...]
    gpus_per_node: int
    """The fewest GPUs any node of the allocation holds."""
    cpus_per_node: int
    """The fewest CPUs any node of the allocation holds."""


def require_allocation(env: Mapping[str, str]) -> str:
    """The allocation's job id; outside one, the one-line refusal."""
    job_id = env.get("SLURM_JOB_ID", "")
    if not job_id or not env.get("SLURM_JOB_NODELIST"):
        raise HpcrlError(
            "hpcrl debug --here uses the allocation you are in, and this shell is in none (no SLURM_JOB_ID); "
            "run it inside `salloc -N NODES --gpus-per-node=G` or `srun ... --pty bash`, or drop --here "
            "to submit a debug job"
        )
    return job_id


def _slurm(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return ""


def _count_ids(ids: str) -> int:
    """``0-3,8`` -> 5."""
    total = 0
    for part in filter(None, ids.split(",")):
        first, _, last = part.partition("-")
        total += int(last or first) - int(first) + 1
    return total


def per_node(detail: str) -> tuple[int, int]:
    """(GPUs, CPUs) of the allocation's smallest node, from ``scontrol show job -d``: one line per group of
    like nodes, e.g. ``Nodes=gpu[01-02] CPU_IDs=0-63 Mem=0 GRES=gpu:h100:4(IDX:0-3)``."""
    gpus, cpus = [], []
    for m in re.finditer(r"^\s+Nodes=\S+ CPU_IDs=(\S+) .*?GRES=(\S*)", detail, re.M):
        cpus.append(_count_ids(m.group(1)))
        gpus.append(sum(int(n) for n in re.findall(r"gpu(?::[^:(,]+)?:(\d+)", m.group(2))))
    return (min(gpus), min(cpus)) if cpus else (0, 1)


def allocation(env: Mapping[str, str]) -> Allocation:
    """The allocation this shell is in: nodes from the environment, GPUs and CPUs per node from Slurm."""
    job_id = require_allocation(env)
    hosts = _slurm(["scontrol", "show", "hostnames", env["SLURM_JOB_NODELIST"]]).split()
    detail = _slurm(["scontrol", "show", "job", "-d", job_id])
    if not hosts or "JobState=RUNNING" not in detail:
        raise HpcrlError(
            f"allocation {job_id} (SLURM_JOB_ID) is not running according to `scontrol show job -d {job_id}`; "
            "start a new one with salloc"
        )
    gpus, cpus = per_node(detail)
    return Allocation(job_id, tuple(hosts), gpus, cpus)


def check_fits(plan: Plan, alloc: Allocation) -> None:
    """Refuse a plan that needs more nodes or GPUs per node than the allocation holds (fewer is fine)."""
    nodes, gpus = plan.job_nodes, plan.cfg.cluster.gpus_per_node
    if len({n for n in node_gpus(plan) if n}) > 1:  # one step asks one --gpus-per-node of every node
        raise HpcrlError(
            f"this config's nodes have {node_gpus(plan)} GPUs (a node kind's own gpus_per_node), and a --here "
            "session's step gives every node the same; submit it (hpcrl submit) or drop that gpus_per_node"
        )
    short = []
    if nodes > len(alloc.hosts):
        short.append(f"{nodes - len(alloc.hosts)} node(s)")
    if gpus > alloc.gpus_per_node:
        short.append(f"{gpus - alloc.gpus_per_node} GPU(s) per node")
    if short:
        raise HpcrlError(
            f"this config needs {nodes} node(s) with {gpus} GPU(s) each; allocation {alloc.job_id} holds "
            f"{len(alloc.hosts)} with {alloc.gpus_per_node}: {' and '.join(short)} short; ask salloc for "
            f"-N {nodes} --gpus-per-node={gpus}, or shrink layout.* / cluster.gpus_per_node"
        )


def check_free(job_id: str, root: Path) -> None:
    """Refuse a second Ray in an allocation that has one of hpcrl's already (its ports are taken, and
    the new session would hide the old one from `hpcrl run`): an hpcrl job's own allocation (an
    ``attach`` shell), or a ``--here`` session whose step still runs."""
    from hpcrl.launch import lifecycle

    try:
        run_dir = lifecycle.run_dir_of(job_id, root)
        step = lifecycle.here_step(run_dir)
    except (HpcrlError, OSError):  # none recorded, or its run directory is gone
        return
    if step is None or (step and lifecycle.step_running(step)):
        raise HpcrlError(
            f"allocation {job_id} already runs hpcrl's Ray (run dir {run_dir}); use it: "
            f"`hpcrl run --job {job_id} --root {root} ...`, or stop it first (`hpcrl cancel {job_id} --root {root}`)"
        )


def srun_script(plan: Plan, alloc: Allocation, run_dir: Path) -> str:
    """The shell script that starts the session's Ray step: the sbatch script's set-up lines, then srun."""
    from hpcrl.launch.sbatch import setup_lines, srun_args

    cluster, nodes = plan.cfg.cluster, plan.job_nodes
    logs = run_dir / SUBMITIT_DIR / "%j_%t_log"  # the names `hpcrl logs` reads (submitit's)
    flags = [
        f"--jobid={alloc.job_id}",
        "--overlap",  # beside the user's own shell step, which may hold every CPU and GPU
        "--job-name=hpcrl-debug",
        f"--nodes={nodes}",
        f"--ntasks={nodes}",
        "--ntasks-per-node=1",
        f"--nodelist={','.join(alloc.hosts[:nodes])}",
        f"--cpus-per-task={alloc.cpus_per_node}",
        *([f"--gpus-per-node={cluster.gpus_per_node}"] if cluster.gpus_per_node else []),
        *srun_args(cluster, run_dir),
        f"--output={logs}.out",
        f"--error={logs}.err",
    ]
    python = cluster.python or shlex.quote(sys.executable)  # a shell word, as in the sbatch script
    task = shlex.quote(str(run_dir / SUBMITIT_DIR / TASK_FILE))
    return "\n".join(
        [
            "#!/bin/bash",
            f"# hpcrl debug --here: Ray on allocation {alloc.job_id}'s nodes (started and stopped by hpcrl)",
            *setup_lines(plan),
            "# the step is what the flags below say, not what the SLURM_* of the user's shell step say",
            'for v in $(compgen -e); do case $v in SLURM_CONF) ;; SLURM_*) unset "$v" ;; esac; done',
            f"exec srun {shlex.join(flags)} {python} -m hpcrl.launch.here {task}",
            "",
        ]
    )


def write_session(plan: Plan, alloc: Allocation) -> Path:
    """The session's run directory, as ``hpcrl debug`` writes it (config, token, job.json, the ``.jobs``
    index), with the node task and ``srun.sh`` in place of the sbatch script."""
    from hpcrl.hub.check import pin_inputs
    from hpcrl.launch.doctor import expect_from_plan
    from hpcrl.launch.job import NodeTask
    from hpcrl.launch.mounts import check_mounts
    from hpcrl.launch.ray_cluster import make_token
    from hpcrl.launch.submit import record_job
    from hpcrl.run.rundir import atomic_write_text, new_run_dir, write_resolved_config

    cfg = plan.cfg
    run_dir = new_run_dir(cfg).resolve()
    check_mounts(plan, run_dir)
    pin_inputs(cfg)
    (run_dir / SUBMITIT_DIR).mkdir(parents=True, exist_ok=True)
    write_resolved_config(cfg, run_dir)
    make_token(run_dir)
    roles = plan.node_roles()
    task = NodeTask(
        str(run_dir),
        roles,
        None,  # a debug session: place one actor per node, then hold Ray up
        hold_s=math.inf,
        bootstrap=cfg.cluster.bootstrap,
        expect=expect_from_plan(plan, run_dir=str(run_dir)),
    )
    (run_dir / SUBMITIT_DIR / TASK_FILE).write_bytes(pickle.dumps(task))
    atomic_write_text(run_dir / "srun.sh", srun_script(plan, alloc, run_dir))
    record_job(plan, alloc.job_id, run_dir, roles, cfg.run.name, debug=True, here=True)
    return run_dir


def start_here(
    plan: Plan, alloc: Allocation, watch_pid: int
) -> tuple[Path, Callable[[], str | None], Callable[[], None]]:
    """Write the session's run directory and start its Ray step, held by a reaper that watches
    ``watch_pid`` (the user's shell); returns the run directory, a check that says how the step ended
    (None while it runs), and a stop."""
    run_dir = write_session(plan, alloc)
    log_path = run_dir / SUBMITIT_DIR / "here_srun.log"
    reaper = [sys.executable, "-m", "hpcrl.launch.reaper", "--watch", str(watch_pid)]
    with open(log_path, "ab") as log:
        holder = subprocess.Popen(
            [*reaper, "--grace", str(HOLD_GRACE_S), "--", "bash", str(run_dir / "srun.sh")],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # the shell's Ctrl-C and job control do not reach it; leaving it does
        )

    def ended() -> str | None:
        code = holder.poll()
        return None if code is None else f"its srun exited with code {code}; srun's words in {log_path}"

    return run_dir, ended, holder.terminate


def main(argv: list[str]) -> int:
    """One node's task of the session's step."""
    task = pickle.loads(Path(argv[0]).read_bytes())
    task()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
