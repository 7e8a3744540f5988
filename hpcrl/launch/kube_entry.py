"""The RayJob's entrypoint (``python -m hpcrl.launch.kube_entry RUN_DIR``): the driver an sbatch job runs on
its head node, joining the Ray cluster KubeRay already started instead of bootstrapping one.

The run directory (on a shared volume) holds the plan as ``hpcrl submit`` pickled it (``plan.pkl``); the
pods' token file and ``RAY_AUTH_MODE`` come from the manifest (``launch/kuberay.py``), the cluster's address
from ``RAY_ADDRESS``, which Ray's job server sets for the driver it starts.

Preemption: a Spot VM's reclaim (or a node drain) deletes the pods and their containers get SIGTERM. As
on Slurm's warning signal, the driver saves after the step in flight (``run/preempt.py``) and exits 75
("run again"); the RayJob fails and KubeRay retries it (``backoffLimit`` = ``cluster.slurm.max_requeues``):
a new RayCluster runs this same entrypoint with the same run directory, and ``run_loop`` resumes from its
newest checkpoint, as a requeued sbatch job does. A worker pod lost without warning ends the attempt
without that save; the retry resumes from the last periodic checkpoint.
"""

from __future__ import annotations

import json
import pickle
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

PLAN_FILE = "plan.pkl"
DRIVER_LOG = "driver.log"
"""The driver's output, every attempt appended: what ``hpcrl logs`` reads where the run directory is visible."""
RESULT_FILE = "result.json"
"""The finished run's last metrics (as submitit's result file for a Slurm job)."""


class _Tee:
    def __init__(self, *streams: IO[str]) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding: the console's
        return getattr(self.streams[0], name)


@contextmanager
def teed(path: Path) -> Iterator[None]:
    """stdout and stderr (the driver's and, through Ray's log monitor, its actors') also into ``path``."""
    saved = sys.stdout, sys.stderr
    with path.open("a", buffering=1) as log:
        sys.stdout, sys.stderr = _Tee(saved[0], log), _Tee(saved[1], log)
        try:
            yield
        finally:
            sys.stdout, sys.stderr = saved


def main(argv: list[str]) -> int:
    from hpcrl.run.driver import run_loop
    from hpcrl.run.preempt import EXIT_PREEMPTED, Preempted, saving_on_signals

    run_dir = Path(argv[0])
    plan = pickle.loads((run_dir / PLAN_FILE).read_bytes())

    def join(_scratch: Path) -> None:
        import ray

        ray.init(
            address="auto", log_to_driver=True, configure_logging=False
        )  # RAY_ADDRESS: the job's cluster

    with teed(run_dir / DRIVER_LOG), saving_on_signals():
        try:
            # slurm=True: the actors ask for the cluster's GPUs and spread over the role groups' pods
            metrics = run_loop(plan, run_dir, join, slurm=True)
        except Preempted as stop:
            print(f"hpcrl: {stop}; exiting {EXIT_PREEMPTED}: KubeRay's retry resumes here", flush=True)
            return EXIT_PREEMPTED
    (run_dir / RESULT_FILE).write_text(json.dumps(metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
