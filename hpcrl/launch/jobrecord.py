"""What status/logs/cancel read of a submitted job, Slurm's or Kubernetes': ``job.json`` in its run
directory and its entry in ``<output_root>/.jobs``."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from hpcrl.launch.kube_entry import DRIVER_LOG
from hpcrl.launch.sbatch import SUBMITIT_DIR, container_args
from hpcrl.plan.components import node_gpus
from hpcrl.plan.planner import Plan
from hpcrl.run.rundir import atomic_write_text

JOBS_INDEX = ".jobs"
"""``<output_root>/.jobs/<job id>`` holds the run directory of each submitted job."""


@dataclass(frozen=True)
class Submitted:
    job_id: str
    run_dir: Path

    @property
    def logs(self) -> list[Path]:
        if json.loads((self.run_dir / "job.json").read_text()).get("scheduler") == "kuberay":
            return [self.run_dir / DRIVER_LOG]  # the RayJob's driver
        return [self.run_dir / SUBMITIT_DIR / f"{self.job_id}_{i}_log.out" for i in range(self.nodes)]

    @property
    def nodes(self) -> int:
        return int(json.loads((self.run_dir / "job.json").read_text())["nodes"])


def record_job(
    plan: Plan,
    job_id: str,
    run_dir: Path,
    roles: list[str],
    name: str,
    *,
    debug: bool = False,
    here: bool = False,
    extra: dict[str, str] | None = None,
) -> Submitted:
    """``job.json`` in the run directory and the ``.jobs`` index entry: what status/logs/cancel read.
    ``here``: a ``debug --here`` session, one step of an allocation the user holds (``launch/here.py``).
    ``extra``: more keys (a Kubernetes job's scheduler, namespace and kind: ``launch/kube_jobs.py``)."""
    cfg = plan.cfg
    meta = {
        "job_id": job_id,
        "nodes": len(roles),
        "submitted": time.time(),
        "roles": roles,
        "cluster": cfg.cluster.name,
        "name": name,
        "debug": debug,
        "here": here,
        "gpus_per_node": cfg.cluster.gpus_per_node,
        "node_gpus": node_gpus(plan),  # each node's own (a heterogeneous job's components may differ)
        "python": cfg.cluster.python,
        "container_args": container_args(cfg.cluster, run_dir),
        **(extra or {}),
    }
    atomic_write_text(run_dir / "job.json", json.dumps(meta, indent=1))
    index = Path(cfg.run.output_root) / JOBS_INDEX
    index.mkdir(parents=True, exist_ok=True)
    atomic_write_text(index / job_id, str(run_dir))
    return Submitted(job_id, run_dir)
