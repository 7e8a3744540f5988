"""The RayJob's entrypoint (``python -m hpcrl.launch.kube_entry RUN_DIR``): the driver an sbatch job runs on
its head node, joining the Ray cluster KubeRay already started instead of bootstrapping one.

The run directory (on a shared volume) holds the plan as ``hpcrl submit`` pickled it (``plan.pkl``); the
pods' token file and ``RAY_AUTH_MODE`` come from the manifest (``launch/kuberay.py``).
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

PLAN_FILE = "plan.pkl"


def main(argv: list[str]) -> int:
    from hpcrl.run.driver import run_loop

    run_dir = Path(argv[0])
    plan = pickle.loads((run_dir / PLAN_FILE).read_bytes())

    def join(_scratch: Path) -> None:
        import ray

        ray.init(address="auto", log_to_driver=True, configure_logging=False)

    # slurm=True: the actors ask for the cluster's GPUs and spread over the role groups' nodes, as in a job
    run_loop(plan, run_dir, join, slurm=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
