"""``hpcrl eval MODEL ... cluster=<a Slurm cluster>``: the eval as a one-node Slurm job.

The job is built by the same submitit executor as ``hpcrl submit`` (``launch/sbatch.py``: partition,
account, container, time limit, environment from the cluster's config), asks for one node, and runs
``hpcrl eval`` there with the same arguments; the command returns once the job is queued. Its files
(eval.json, samples.jsonl, the job's logs under ``slurm/``) land in the eval directory, and
``hpcrl status|logs|cancel JOB --root <run.output_root>`` follow it like a training job.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

from hpcrl.errors import HpcrlError
from hpcrl.launch.sbatch import make_executor, srun_args
from hpcrl.launch.submit import JOBS_INDEX, Submitted
from hpcrl.plan.planner import make_plan
from hpcrl.run.rundir import atomic_write_text


class EvalTask:
    """Picklable callable: submitit runs it on the job's node."""

    def __init__(self, run_eval: Any, overrides: list[str], spec: str, out: str, against: str | None) -> None:
        """``run_eval``: ``hpcrl.run.evaluate.run_eval``, handed in (pickled by name), so that this
        module does not import the eval it queues."""
        self.run_eval = run_eval
        self.overrides, self.spec, self.out, self.against = overrides, spec, out, against

    def __call__(self) -> int:
        # scancel / the time limit send SIGTERM, which submitit ignores: end the eval (and its reward
        # processes, through the pool's ``with``) at once
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        return int(self.run_eval(self.overrides, self.spec, Path(self.out), self.against, here=True))


def absolute(spec: str) -> str:
    """A MODEL that is a path, made absolute: the job may start in another directory."""
    return str(Path(spec).resolve()) if Path(spec).exists() else spec


def submit_eval(
    run_eval: Any, cfg: Any, out: Path, overrides: list[str], spec: str, against: str | None
) -> Submitted:
    """Queue the eval of ``spec`` (into ``out``) on one node of ``cfg.cluster``; returns at once."""
    plan = make_plan(cfg)
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    task = EvalTask(run_eval, overrides, absolute(spec), str(out), absolute(against) if against else None)
    try:
        executor = make_executor(plan, out)
        executor.update_parameters(nodes=1, job_name=f"eval-{out.name}")
        job = executor.submit(task)
    except Exception as exc:  # submitit raises with sbatch's own words
        reason = " ".join(str(exc).split())[:400]
        raise HpcrlError(
            f"submission to Slurm failed ({reason}); check that sbatch works here "
            f"(SLURM_CONF, partition/account in cluster.slurm.*)"
        ) from None
    meta = {
        "job_id": job.job_id,
        "nodes": 1,
        "submitted": time.time(),
        "roles": ["eval"],
        "cluster": cfg.cluster.name,
        "name": f"eval-{out.name}",
        "debug": False,
        "gpus_per_node": cfg.cluster.gpus_per_node,
        "python": cfg.cluster.python,
        "container_args": [
            a for a in srun_args(cfg.cluster) if a.startswith(("--container", "--no-container"))
        ],
    }
    atomic_write_text(out / "job.json", json.dumps(meta, indent=1))
    index = Path(cfg.run.output_root) / JOBS_INDEX
    index.mkdir(parents=True, exist_ok=True)
    atomic_write_text(index / str(job.job_id), str(out))
    return Submitted(str(job.job_id), out)
