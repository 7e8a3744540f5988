"""Run the whole loop on this machine: a local Ray, then the driver (``driver.run_loop``).

This is what ``hpcrl submit`` does when the cluster is ``local`` (the embedded default).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from hpcrl.launch.orphans import start_watcher
from hpcrl.plan.planner import Plan
from hpcrl.run.driver import run_loop
from hpcrl.run.rayprocs import start_holding_term
from hpcrl.run.rundir import new_run_dir, write_resolved_config


def start_local_ray(plan: Plan, scratch: Path) -> None:
    """Ray reads its auth settings when first imported, so the environment is set before ``import ray``."""
    if "ray" in sys.modules:
        raise RuntimeError("internal: ray was imported before its auth settings were made")
    from hpcrl.launch.ray_cluster import auth_env, make_token

    # Token auth even on a laptop, with the token in a private file (Ray's own default file is 0644).
    os.environ.update(auth_env(make_token(scratch)))
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep every listener on 127.0.0.1
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    start_watcher()  # Ray's agents outlive a killed driver: launch/orphans.py
    import ray

    # scancel of a run inside an allocation sends SIGTERM to every process of the step: Ray's processes
    # start with it blocked, so that the driver can save the step first (run/rayprocs.py)
    start_holding_term(lambda: _init(ray, plan, scratch))


def _init(ray: Any, plan: Plan, scratch: Path) -> None:
    from hpcrl.plan.topology import on_gpus
    from hpcrl.run.actors import ROLLOUT_RESOURCE, TRAIN_RESOURCE

    ray.init(
        num_cpus=os.cpu_count() or 1,
        # the GPU the plan found (cluster.gpu=auto: plan/local_gpu.py), or none: Ray's own detection
        # would also claim a GPU the plan was told not to use (cluster.gpu=cpu)
        num_gpus=plan.topology.gpus_per_node if on_gpus(plan.cfg.cluster) else 0,
        resources={TRAIN_RESOURCE: 1, ROLLOUT_RESOURCE: plan.topology.rollout.tp},
        include_dashboard=False,
        _temp_dir=str(scratch / "ray"),
        _node_ip_address="127.0.0.1",
        log_to_driver=True,
        configure_logging=False,
    )


def run_local(plan: Plan) -> dict[str, float]:
    """The loop on this machine. USR2 (what Slurm sends before a time limit, e.g. inside an
    allocation), SIGTERM and SIGINT save a checkpoint after the current step and stop with
    ``Preempted`` (``run/preempt.py``)."""
    from hpcrl.run.preempt import Preempted, saving_on_signals

    run_dir = new_run_dir(plan.cfg).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    write_resolved_config(plan.cfg, run_dir)
    try:
        with saving_on_signals():
            return run_loop(plan, run_dir, lambda scratch: start_local_ray(plan, scratch), slurm=False)
    except Preempted as stop:
        stop.resume = f"run.dir={run_dir}"
        raise
