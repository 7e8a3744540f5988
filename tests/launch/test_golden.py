"""Golden sbatch files: each shipped Slurm recipe renders exactly to ``sbatch/<recipe>.sbatch``."""

from __future__ import annotations

import re
import sys

import pytest

from hpcrl.launch.golden import GOLDEN_DIR, recipes, render_recipe

SLURM_RECIPES = [r for r in recipes() if render_recipe(r) is not None]
REPO = GOLDEN_DIR.parent
REFRESH = "if this change is intended, refresh them with `.venv/bin/python -m hpcrl.launch.golden`"


@pytest.mark.parametrize("recipe", SLURM_RECIPES)
def test_render_matches_golden(recipe):
    path = GOLDEN_DIR / f"{recipe}.sbatch"
    assert path.exists(), f"sbatch/{recipe}.sbatch is missing; {REFRESH}"
    assert render_recipe(recipe) == path.read_text(), f"rendering of {recipe} changed; {REFRESH}"


def test_no_stale_golden_files():
    stale = {p.stem for p in GOLDEN_DIR.glob("*.sbatch")} - set(SLURM_RECIPES)
    assert not stale, f"golden files without a recipe: {sorted(stale)}; delete them"


def test_golden_scripts_hold_no_secrets_or_machine_paths():
    for path in GOLDEN_DIR.glob("*.sbatch"):
        text = path.read_text()
        for word in (
            "HF_TOKEN",
            "WANDB_API_KEY",
            "RAY_AUTH",
            "/root",
            "/home/",
            str(REPO),  # this checkout's own location: machine-specific
            sys.executable,
        ):
            assert word not in text, f"{path.name} contains {word}"


def test_split_recipe_runs_one_task_per_node_fail_fast():
    text = (GOLDEN_DIR / "dapo-nemotron-super-5n4g-megatron.sbatch").read_text()
    assert "#SBATCH --nodes=5\n" in text and "#SBATCH --ntasks-per-node=1\n" in text
    assert "#SBATCH --segment=5\n" in text and "--kill-on-bad-exit=1" in text
    assert "export HPCRL_ROLES=rollout,train,train,train,train" in text
    assert "--container-image=IMAGE" in text and "NCCL_MNNVL_ENABLE=1" in text


@pytest.mark.parametrize("recipe", SLURM_RECIPES)
def test_the_container_mounts_the_run_dir_and_cache_and_jobs_run_offline(recipe):
    """No site mount shows /RUN_DIR or /HF_HOME, so both are mounted as themselves; a GB200 job (IMEX on,
    no fixed channel) also gets the channel directory Slurm fills at run time."""
    text = (GOLDEN_DIR / f"{recipe}.sbatch").read_text()
    (mounts,) = re.findall(r" --container-mounts=(\S+) ", text)
    expected = [f"/RUN_DIR/{recipe}:/RUN_DIR/{recipe}", "/HF_HOME:/HF_HOME"]
    if "NCCL_MNNVL_ENABLE=1" in text:  # the GB200 recipes
        expected.append("/dev/nvidia-caps-imex-channels:/dev/nvidia-caps-imex-channels")
    assert mounts.split(",") == expected
    assert "\nexport HF_HUB_OFFLINE=1 " in text and "\nexport HF_HOME=/HF_HOME\n" in text
