"""The sbatch script, written by submitit's own Slurm executor from the plan's typed fields.

``render_sbatch`` and ``hpcrl submit`` build the executor with the same function, so the text
``hpcrl render`` shows is the text that gets submitted. Secrets are never written: sbatch
exports the submitting shell's environment (HF_TOKEN, WANDB_API_KEY) to the job by itself.
The srun arguments depend on the run directory: the container mounts it (``launch/mounts.py``).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

from hpcrl.config.cluster import ClusterConfig
from hpcrl.launch.hetjob import components, het_sbatch, srun_het_groups
from hpcrl.launch.mounts import job_mounts
from hpcrl.plan.planner import Plan

SUBMITIT_DIR = "slurm"
"""Run-directory subfolder where submitit keeps its pickles and per-task logs."""


def slurm_parameters(plan: Plan, run_dir: Path | None = None) -> dict[str, Any]:
    """submitit ``update_parameters`` arguments for this plan (one task per node); ``run_dir`` None
    (``hpcrl plan``'s summary) leaves the run directory's mount out of ``srun_args``."""
    cfg, cluster = plan.cfg, plan.cfg.cluster
    site = cluster.slurm
    params: dict[str, Any] = {
        "job_name": cfg.run.name,
        "nodes": plan.job_nodes,
        "ntasks_per_node": 1,
        "gpus_per_node": cluster.gpus_per_node,
        "cpus_per_task": cluster.cpus_per_node,
        "time": site.time_minutes(),
        "signal_delay_s": site.signal_delay_s,
        "srun_args": srun_args(cluster, run_dir) + srun_het_groups(components(plan)),
        "setup": setup_lines(plan),
    }
    optional = {
        "partition": site.partition,
        "account": site.account,
        "qos": site.qos,
        "constraint": site.constraint,
    }
    params.update({k: v for k, v in optional.items() if v})
    if site.exclusive:
        params["exclusive"] = True
        params["mem"] = "0"  # all of each node's memory
    extra: dict[str, Any] = {"requeue": True}
    if site.reservation:
        extra["reservation"] = site.reservation
    if site.segment:
        extra["segment"] = site.segment
    # checked by SlurmSite.check_extra_sbatch: none of them is one hpcrl sets above
    extra.update({name.replace("-", "_"): value for name, value in site.extra_sbatch.items()})
    params["additional_parameters"] = extra
    return params


def container_args(cluster: ClusterConfig, run_dir: Path | None = None) -> list[str]:
    """The pyxis container flags of ``srun_args``: what a later ``srun --overlap`` into the job repeats
    (``hpcrl attach``, ``doctor --job``), so it sees the same files; ``run_dir``: the job's."""
    return [a for a in srun_args(cluster, run_dir) if a.startswith(("--container", "--no-container"))]


def srun_args(cluster: ClusterConfig, run_dir: Path | None) -> list[str]:
    # --kill-on-bad-exit: one node's task failing ends the step at once instead of idling the others.
    args = ["--kill-on-bad-exit=1", "--cpu-bind=none"]
    container = cluster.container
    if container.image:
        args.append(f"--container-image={container.image}")
        args.append("--container-mounts=" + ",".join(job_mounts(cluster, run_dir)))
        if container.workdir:
            args.append(f"--container-workdir={container.workdir}")
        args.append("--no-container-mount-home")
    return args


def setup_lines(plan: Plan) -> list[str]:
    """The batch script's lines before srun: the site's ``cluster.setup`` first, then hpcrl's."""
    cfg = plan.cfg
    cluster = cfg.cluster
    if cluster.setup:
        # -u after the site's lines: module scripts read variables that may be unset
        lines = ["set -eo pipefail", "# cluster.setup", *cluster.setup, "set -u"]
    else:
        lines = ["set -euo pipefail"]
    lines += [
        'ulimit -Sn "$(ulimit -Hn)" 2>/dev/null || true  # Ray opens many sockets per worker',
        f"export HPCRL_ROLES={shlex.quote(','.join(plan.node_roles()))}",
        'export HPCRL_JOB_START="$(date +%s.%N)"  # the head reports seconds from here to "Ray ready"',
    ]
    if cfg.model.fetch != "job" and "HF_HUB_OFFLINE" not in cluster.env:
        lines.append("export HF_HUB_OFFLINE=1  # models and data sets come from HF_HOME (`hpcrl fetch`)")
    for name in sorted(cluster.env):
        lines.append(f"export {name}={shlex.quote(str(cluster.env[name]))}")
    if cluster.imex.enabled and cluster.imex.channel is not None:
        lines.append(f"export HPCRL_IMEX_CHANNEL={cluster.imex.channel}")
    # what this script once only warned about (no IMEX channel) is now a failing check on the node
    lines.append("# each node first runs hpcrl doctor (GPUs, IMEX, versions, paths, disk, ports) before Ray")
    return lines


def make_executor(plan: Plan, run_dir: Path, *, offline: bool = False) -> Any:
    """A submitit SlurmExecutor configured for this plan, logging under ``run_dir/slurm``.

    ``offline`` builds the same executor on a machine without ``srun`` (rendering only).
    """
    from submitit import SlurmExecutor

    parts = components(plan)

    class Executor(SlurmExecutor):
        @classmethod
        def affinity(cls) -> int:
            # offline: submitit refuses to build an executor where srun is missing
            return 1 if offline else int(super().affinity())

        def _make_submission_file_text(self, command: str, uid: str) -> str:
            text = str(super()._make_submission_file_text(command, uid))
            return text if parts is None else het_sbatch(text, parts)  # nodes of their own kind

    executor = Executor(
        folder=run_dir / SUBMITIT_DIR,
        max_num_timeout=plan.cfg.cluster.slurm.max_requeues,
        python=plan.cfg.cluster.python or shlex.quote(sys.executable),
    )
    executor.update_parameters(**slurm_parameters(plan, run_dir))
    return executor


def render_sbatch(plan: Plan, run_dir: Path) -> str:
    """The exact sbatch text ``hpcrl submit`` would hand to Slurm for this plan and run dir."""
    executor = make_executor(plan, run_dir, offline=True)
    return str(executor._make_submission_file_text(executor._submitit_command_str, uid="render"))
