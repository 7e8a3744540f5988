"""``hpcrl eval MODEL ... cluster=<a Slurm cluster>``: the eval as a one-node Slurm job.

The job is built by the same submitit executor as ``hpcrl submit`` (``launch/sbatch.py``: partition,
account, container, time limit, environment from the cluster's config), asks for one node, and runs
``hpcrl eval`` there with the same arguments; the command returns once the job is queued. Its files
(eval.json, samples.jsonl, the job's logs under ``slurm/``) land in the eval directory, and
``hpcrl status|logs|cancel JOB --root <run.output_root>`` follow it like a training job.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from hpcrl.launch.submit import Submitted, record_job, submit_task
from hpcrl.plan.planner import make_plan


class EvalTask:
    """Picklable callable: submitit runs it on the job's node."""

    def __init__(self, run_eval: Any, overrides: list[str], spec: str, out: str, against: str | None) -> None:
        """``run_eval``: ``hpcrl.tools.evaluate.run_eval``, handed in (pickled by name), so that this
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
    job_id = submit_task(plan, out, task, nodes=1, job_name=f"eval-{out.name}")
    return record_job(plan, job_id, out, ["eval"], f"eval-{out.name}")
