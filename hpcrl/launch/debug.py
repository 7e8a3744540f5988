"""Interactive work on a held allocation: ``hpcrl debug`` / ``attach`` / ``run``.

``debug`` submits the same job as ``submit`` (same sbatch, same Ray bootstrap) whose driver only
checks placement and then keeps the Ray cluster up until the time limit or ``hpcrl cancel``.
``attach`` opens a shell (or runs one command) on a node of it with ``srun --overlap``, inside the
job's container when it has one. ``run`` runs the RL driver against that cluster, as often as you
like, without restarting Ray: on the head node directly, or from elsewhere through ``srun --overlap``
onto the head (a Ray driver has to live on a node of the cluster).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpcrl.errors import HpcrlError
from hpcrl.launch import lifecycle
from hpcrl.plan.components import node_gpus
from hpcrl.plan.planner import Plan

READY_TIMEOUT_S = 900.0


def wait_ready(
    job_id: str,
    run_dir: Path,
    timeout_s: float,
    say: Callable[[str], None],
    ended: Callable[[], str | None] | None = None,
) -> dict[str, Any]:
    """Block until the held job's Ray cluster is up; fail at once if the job ends first.
    ``ended``: how a ``debug --here`` session's Ray step ended (None while it runs), in place of the job."""
    ready = run_dir / "ray" / f"ready-{job_id}.json"
    deadline, last = time.monotonic() + timeout_s, ""
    while not ready.exists():
        if ended:
            gone, state = ended(), "starting Ray in the allocation"
        else:
            state = lifecycle.job_state(job_id, run_dir)
            gone = None if state.split()[0] in lifecycle.ACTIVE else state
        if gone:
            raise HpcrlError(
                f"debug session {job_id} ended ({gone}) before its Ray cluster was up; "
                f"see `hpcrl logs {job_id}`"
            )
        if state != last:
            say(f"job {job_id}: {state}")
            last = state
        if time.monotonic() > deadline:
            kept = "stopped" if ended else f"it stays queued (`hpcrl cancel {job_id}` to drop it)"
            raise HpcrlError(f"debug job {job_id} is still {state} after {timeout_s:.0f}s; {kept}")
        time.sleep(0.5)
    return dict(json.loads(ready.read_text()))


def held(job_id: str, root: Path) -> tuple[lifecycle.JobInfo, dict[str, Any]]:
    """The debug job and its metadata; refuses jobs that are not held debug sessions or have ended."""
    job = lifecycle.info(job_id, root)
    meta = json.loads((job.run_dir / "job.json").read_text())
    if not meta.get("debug"):
        raise HpcrlError(f"job {job_id} is not a debug session (start one with `hpcrl debug <overrides>`)")
    if job.state.split()[0] != "RUNNING":
        raise HpcrlError(
            f"debug job {job_id} is {job.state}, not RUNNING; start a new one with `hpcrl debug`"
        )
    step = lifecycle.here_step(job.run_dir)
    if step is not None and not (step and lifecycle.step_running(step)):
        raise HpcrlError(
            f"the debug session in allocation {job_id} has stopped its Ray (step {step or 'never started'}); "
            "start it again with `hpcrl debug --here`"
        )
    return job, meta


def node_hosts(run_dir: Path, nodes: int) -> list[str]:
    return [json.loads((run_dir / "nodes" / f"{i}.json").read_text())["host"] for i in range(nodes)]


def attach_argv(job_id: str, meta: dict[str, Any], host: str, command: list[str]) -> list[str]:
    argv = [
        "srun",
        f"--jobid={job_id}",
        "--overlap",
        "--nodes=1",
        "--ntasks=1",
        f"--nodelist={host}",
        *meta.get("container_args", []),
    ]
    return [*argv, *command] if command else [*argv, "--pty", os.environ.get("SHELL", "/bin/bash"), "-l"]


def check_fits_allocation(plan: Plan, job_id: str, meta: dict[str, Any]) -> None:
    roles = plan.node_roles()
    if roles != meta["roles"]:
        raise HpcrlError(
            f"this config needs {len(roles)} node(s) with roles {roles}, but debug job {job_id} holds "
            f"{meta['nodes']} with roles {meta['roles']}; change layout.train_nodes/rollout_nodes to match, "
            "or start a debug session for this config"
        )
    gpus = plan.cfg.cluster.gpus_per_node
    if gpus != meta.get("gpus_per_node", gpus):
        raise HpcrlError(
            f"this config uses {gpus} GPUs per node; debug job {job_id} holds {meta['gpus_per_node']}"
        )
    each = node_gpus(plan)  # a node kind's own count (cluster.rollout_node.gpus_per_node ...)
    if each != meta.get("node_gpus", each):
        raise HpcrlError(
            f"this config's nodes have {each} GPUs; debug job {job_id}'s have {meta['node_gpus']}: "
            "match cluster.rollout_node/judge_node.gpus_per_node, or start a debug session for this config"
        )


def driver_argv(job_id: str, meta: dict[str, Any], head: str, root: Path, overrides: list[str]) -> list[str]:
    python = meta.get("python") or sys.executable
    return attach_argv(
        job_id,
        meta,
        head,
        [python, "-m", "hpcrl.cli", "run", "--here", "--job", job_id, "--root", str(root), *overrides],
    )


def run_here(plan: Plan, job: lifecycle.JobInfo) -> Path:
    """The driver, on a node of the held cluster: connect with the job's token and train."""
    from hpcrl.launch.ray_cluster import auth_env
    from hpcrl.run.driver import run_loop
    from hpcrl.run.preempt import Preempted, saving_on_signals
    from hpcrl.run.rundir import write_resolved_config

    head = json.loads((job.run_dir / "ray" / f"head-{job.job_id}.json").read_text())
    if "ray" in sys.modules:
        raise RuntimeError("internal: ray was imported before its auth settings were made")
    os.environ.update(auth_env(job.run_dir / "ray" / "token"))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = job.run_dir / "runs" / f"{plan.cfg.run.name}-{stamp}"
    run_dir.mkdir(parents=True, exist_ok=True)
    write_resolved_config(plan.cfg, run_dir)

    def connect(_scratch: Path) -> None:
        import ray

        ray.init(address=f"{head['ip']}:{head['port']}", log_to_driver=True, configure_logging=False)

    print(f"hpcrl: driver on {socket.gethostname()} against job {job.job_id}'s Ray cluster", flush=True)
    try:  # Ctrl-C and SIGTERM save after the step (the session's Ray, in its own job, lives on)
        with saving_on_signals():
            run_loop(plan, run_dir, connect, slurm=True)
    except Preempted as stop:
        stop.resume = f"checkpoint.dir={plan.cfg.checkpoint.dir or run_dir / 'checkpoints'}"
        raise
    return run_dir


def run_in_session(job_id: str, root: Path, overrides: list[str], *, here: bool) -> int:
    """``hpcrl run``: the driver on the held session's head node (from elsewhere: through srun)."""
    import subprocess

    from hpcrl.launch.gate import require_submittable
    from hpcrl.plan.planner import plan_from_overrides

    plan = plan_from_overrides(overrides)
    require_submittable(plan)  # the checks plan, render and submit make (one code path)
    job, meta = held(job_id, root)
    check_fits_allocation(plan, job_id, meta)
    head = node_hosts(job.run_dir, 1)[0]
    if here or socket.gethostname() == head:
        run_dir = run_here(plan, job)
        print(f"run dir {run_dir}")
        return 0
    return subprocess.call(driver_argv(job_id, meta, head, root, overrides))


def attach(job_id: str, root: Path, node: str | None, command: list[str]) -> int:
    """``hpcrl attach``: a shell (or ``command``) on a node of a held session; replaces this process."""
    job, meta = held(job_id, root)
    hosts = node_hosts(job.run_dir, job.nodes)
    node = node or hosts[0]
    if node.isdigit() and int(node) < len(hosts):
        node = hosts[int(node)]
    if node not in hosts:
        raise HpcrlError(f"node {node} is not in job {job.job_id} (its nodes: {', '.join(hosts)})")
    argv = attach_argv(job.job_id, meta, node, command)
    sys.stdout.flush()
    os.execvp(argv[0], argv)
    return 1  # not reached
