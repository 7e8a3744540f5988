"""Golden sbatch scripts: every shipped Slurm recipe rendered into ``sbatch/<recipe>.sbatch``; golden KubeRay
manifests (``manifests/``) of recipes on the GKE catalog clusters.

Site keys a real site supplies (account, container image, the Hugging Face cache) are filled with
placeholders, the run directory is ``/RUN_DIR/<recipe>``, and a cluster whose ``python`` is this
machine's interpreter (the namespace test cluster) gets ``/VENV/bin/python``, so the files are the same
on every machine (no site file is read).
Refresh after an intended change: ``.venv/bin/python -m hpcrl.launch.golden``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hpcrl.config.cluster import Scheduler
from hpcrl.config.compose import compose_config, conf_dir
from hpcrl.launch.sbatch import render_sbatch
from hpcrl.plan.planner import make_plan

SITE_PLACEHOLDERS = [
    "cluster.slurm.account=ACCOUNT",
    "cluster.container.image=IMAGE",
    "+cluster.env.HF_HOME=/HF_HOME",
]
GOLDEN_DIR = Path(__file__).resolve().parents[2] / "sbatch"
KUBE_DIR = Path(__file__).resolve().parents[2] / "manifests"
KUBE_CASES = {
    # seed 000's job: Gemma 3 1B, colocated, one a4-highgpu-8g (B200) node
    "grpo-gemma3-1b-it-1n8g-fsdp2tp1-gke_a4": [
        "+experiment=grpo-gemma3-1b-it-1n8g-fsdp2tp1",
        "cluster=gke_a4",
    ],
    # split over a3-ultragpu-8g (H200) nodes, admitted through a Kueue queue
    "grpo-gemma3-1b-it-2n8g-split-gke_a3_ultra": [
        "+experiment=grpo-gemma3-1b-it-1n8g-fsdp2tp1",
        "cluster=gke_a3_ultra",
        "layout.rollout_nodes=1",
        "cluster.kube.queue=dws-queue",
        "cluster.kube.service_account=hpcrl-ksa",
    ],
    # an LLM judge on a node of its own: a worker group of the role "judge" beside the training one
    "grpo-gemma3-1b-it-judge-qwen3-8b-gke_a4": [
        "+experiment=grpo-gemma3-1b-it-1n8g-fsdp2tp1",
        "cluster=gke_a4",
        "+rewards.judge.model=qwen3_8b",
        "+rewards.judge.nodes=1",
        "+rewards.judge.engines=8",
        "+rewards.judge.parse=yes_no",
    ],
}
"""Golden RayJob manifests (``manifests/<name>.yaml``): a recipe on a GKE catalog cluster, site keys as
placeholders, the run directory ``/data/runs/<name>``."""
KUBE_DEBUG = ("grpo-gemma3-1b-it-1n8g-fsdp2tp1-gke_a4",)
"""``KUBE_CASES`` whose ``hpcrl debug`` RayCluster is golden too (``manifests/<name>.raycluster.yaml``)."""


def recipes() -> list[str]:
    return sorted(p.stem for p in (conf_dir() / "experiment").glob("*.yaml"))


def render_recipe(name: str) -> str | None:
    """The sbatch text of one recipe, or None for recipes that run without Slurm."""
    cfg = compose_config([f"+experiment={name}", *SITE_PLACEHOLDERS])
    if cfg.cluster.scheduler is Scheduler.local:
        return None
    if cfg.cluster.python is None:
        cfg.cluster.python = "/VENV/bin/python"
    plan = make_plan(cfg)
    plan.require_fit()
    return render_sbatch(plan, Path("/RUN_DIR") / name)


def render_kube(name: str, debug: bool = False) -> str:
    """The RayJob manifest of one ``KUBE_CASES`` entry; ``debug``: its ``hpcrl debug`` RayCluster."""
    from hpcrl.launch.kuberay import manifest_yaml, raycluster, rayjob

    cfg = compose_config([*KUBE_CASES[name], "cluster.container.image=IMAGE", "run.output_root=/data/runs"])
    plan = make_plan(cfg)
    plan.require_fit()
    run_dir = Path("/data/runs") / name
    return manifest_yaml(raycluster(plan, f"debug-{name}", run_dir) if debug else rayjob(plan, run_dir))


def kube_files() -> dict[str, tuple[str, bool]]:
    """Each golden manifest's file name: (its ``KUBE_CASES`` entry, a debug RayCluster)."""
    files = {f"{name}.yaml": (name, False) for name in KUBE_CASES}
    return files | {f"{name}.raycluster.yaml": (name, True) for name in KUBE_DEBUG}


def main() -> int:
    import os
    import tempfile

    # the golden files hold the catalog's values, not this developer's site file (~/.config/hpcrl)
    os.environ["HPCRL_CONFIG_DIR"] = tempfile.mkdtemp(prefix="hpcrl-golden-")
    GOLDEN_DIR.mkdir(exist_ok=True)
    for name in recipes():
        text = render_recipe(name)
        if text is not None:
            (GOLDEN_DIR / f"{name}.sbatch").write_text(text)
            print(f"wrote sbatch/{name}.sbatch")
    KUBE_DIR.mkdir(exist_ok=True)
    for file, (name, debug) in kube_files().items():
        (KUBE_DIR / file).write_text(render_kube(name, debug))
        print(f"wrote manifests/{file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
