"""The RayJob's entrypoint (``python -m hpcrl.launch.kube_entry RUN_DIR``): the driver an sbatch job runs on
its head node, joining the Ray cluster KubeRay already started instead of bootstrapping one.

The run directory (on a shared volume) holds the plan as ``hpcrl submit`` pickled it (``plan.pkl``); the
pods' token file and ``RAY_AUTH_MODE`` come from the manifest (``launch/kuberay.py``), the cluster's address
from ``RAY_ADDRESS``, which Ray's job server sets for the driver it starts.

Preemption: a Spot VM's reclaim (or a node drain, Kueue's preemption) deletes the pods. Kubernetes runs
each container's preStop hook first (``launch/kube_prestop.py``): it asks this driver to save through a
file in the run directory, which a thread here turns into what SIGTERM to the driver asks for, and holds
its pod up until the driver has exited. As on Slurm's warning signal, the driver saves after the step in
flight (``run/preempt.py``) and exits 75 ("run again"); the RayJob fails and KubeRay retries it
(``backoffLimit`` = ``cluster.slurm.max_requeues``): a new RayCluster runs this same entrypoint with the
same run directory, and ``run_loop`` resumes from its newest checkpoint, as a requeued sbatch job does.
A pod lost without warning, or a save longer than the grace period, ends the attempt without that
save; the retry resumes from the last periodic checkpoint.
"""

from __future__ import annotations

import json
import pickle
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from hpcrl.launch.kube_prestop import answering_prestop

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

    with teed(run_dir / DRIVER_LOG), saving_on_signals(), answering_prestop(run_dir, _pod_deleted) as exited:
        try:
            # slurm=True: the actors ask for the cluster's GPUs and spread over the role groups' pods
            metrics = run_loop(plan, run_dir, join, slurm=True)
        except Preempted as stop:
            print(f"hpcrl: {stop}; exiting {EXIT_PREEMPTED}: KubeRay's retry resumes here", flush=True)
            exited(EXIT_PREEMPTED, stop.step)
            return EXIT_PREEMPTED
        (run_dir / RESULT_FILE).write_text(json.dumps(metrics))
        exited(0, None)
    return 0


def _pod_deleted(pod: str) -> None:
    """A pod's preStop hook asked (``kube_prestop``): the save SIGTERM to the driver asks for."""
    import signal

    from hpcrl.run.preempt import REQUEST

    if not REQUEST.asked:
        print(
            f"hpcrl: pod {pod} is being deleted (its preStop hook asked): saving after the current step, "
            "then stopping",
            file=sys.stderr,
            flush=True,
        )
    REQUEST.ask(signal.SIGTERM)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
