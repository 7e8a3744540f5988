from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.config.compose import compose_config
from hpcrl.config.schema import RunConfig
from hpcrl.plan.planner import Plan, make_plan

ROOT = Path(__file__).resolve().parents[1]
SITE = ["cluster.slurm.account=acct", "cluster.container.image=img.sqsh"]


def compose(*overrides: str) -> RunConfig:
    return compose_config(list(overrides))


def plan(*overrides: str) -> Plan:
    return make_plan(compose(*overrides))


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run the real console entry point installed in the venv."""
    exe = Path(sys.executable).with_name("hpcrl")
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(
        [str(exe), *args], capture_output=True, text=True, cwd=cwd or ROOT, env=env, timeout=timeout
    )


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A randomly initialised tiny model (no warm start): fast to build, real HF checkpoint."""
    from hpcrl.run.tiny_model import ensure_tiny_model

    cfg = compose("model=tiny")
    return ensure_tiny_model(
        cfg.model, tmp_path_factory.mktemp("cache"), sft_steps=0, seed=0, log=lambda _: None
    )


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real 3-node Slurm cluster (namespace nodes) for the whole session; torn down at the end."""
    tool = ROOT / "tools" / "slurm-cluster"
    subprocess.run([str(tool), "up", "3"], check=True, timeout=600)
    conf = "/tmp/hpcrl-slurm/etc/slurm.conf"
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf
    try:
        yield conf
    finally:
        subprocess.run([str(tool), "down"], check=False, timeout=120)
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
