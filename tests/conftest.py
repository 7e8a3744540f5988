from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hpcrl.config.compose import compose_config
from hpcrl.config.schema import RunConfig
from hpcrl.plan.planner import Plan, make_plan

ROOT = Path(__file__).resolve().parents[1]
# No test reads the developer's own site file (~/.config/hpcrl): tests that need one write their own.
os.environ["HPCRL_CONFIG_DIR"] = tempfile.mkdtemp(prefix="hpcrl-config-")
SITE = ["cluster.slurm.account=acct", "cluster.container.image=img.sqsh"]
# vLLM inspects a model's class in a fresh Python process (about 8 s of imports on 2 cores) unless its
# cache under VLLM_CACHE_ROOT has the answer; an engine caches it under its run's scratch directory
# (rollout/vllm_engine.py), which goes with the run. One cache for the session: each engine start after
# the first finds it (keyed by the model file's hash), in every run and Slurm job the tests start.
os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="hpcrl-vllm-"))
HF_HOME = tempfile.mkdtemp(prefix="hpcrl-hf-")
JOB_DOWNLOADS = ["model.fetch=job", f"+cluster.env.HF_HOME={HF_HOME}"]
"""What lets a hub model's plan pass submit's checks (``hpcrl plan`` and ``render`` make them too) on a
machine without its weights: the job downloads them (``model.fetch=job``) into a cache that exists (its
container mounts it)."""
JOB_FETCH = [*SITE, *JOB_DOWNLOADS]


def compose(*overrides: str) -> RunConfig:
    return compose_config(list(overrides))


def plan(*overrides: str) -> Plan:
    return make_plan(compose(*overrides))


ONE_GPU = "H200:150.8"
"""``HPCRL_LOCAL_GPU`` for a one-GPU recipe of cluster=local: the lent H200 as nvidia-smi shows it."""


@contextlib.contextmanager
def local_gpu(value: str | None) -> Iterator[None]:
    """``HPCRL_LOCAL_GPU`` set (None: as it is) while the block plans."""
    old = os.environ.get("HPCRL_LOCAL_GPU")
    if value is not None:
        os.environ["HPCRL_LOCAL_GPU"] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("HPCRL_LOCAL_GPU", None)
        else:
            os.environ["HPCRL_LOCAL_GPU"] = old


def recipe_gpu(recipe: str) -> str | None:
    """The ``HPCRL_LOCAL_GPU`` a shipped recipe is planned with: ONE_GPU for a cluster=local recipe sized
    for a GPU (it does not fit this machine's CPU, as ``hpcrl plan`` here says), else None."""
    p = plan(f"+experiment={recipe}", *SITE)
    return ONE_GPU if p.cfg.cluster.name == "local" and not p.fits else None


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


@pytest.fixture
def fresh_request() -> Iterator[None]:
    """No preemption asked (hpcrl.run.preempt's REQUEST) before the test, nor left after it."""
    from hpcrl.run.preempt import REQUEST

    REQUEST.reset()
    yield
    REQUEST.reset()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A randomly initialised tiny model (no warm start): fast to build, real HF checkpoint."""
    from hpcrl.run.tiny_model import ensure_tiny_model

    cfg = compose("model=tiny")
    return ensure_tiny_model(
        cfg.model, tmp_path_factory.mktemp("cache"), sft_steps=0, seed=0, log=lambda _: None
    )


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory):
    """One ``HPCRL_CACHE`` for the session's end-to-end runs: the first run that needs the
    warm-started tiny model builds it there, the later ones reuse it (a test of the build from an
    empty cache takes it only while it is still empty)."""
    return tmp_path_factory.mktemp("hpcrl_cache")


@pytest.fixture(scope="session")
def _slurm_up():
    """A real 3-node Slurm cluster (namespace nodes) for the whole session; torn down at the end."""
    tool = ROOT / "tools" / "slurm-cluster"
    subprocess.run([str(tool), "up", "3"], check=True, timeout=600)
    try:
        yield "/tmp/hpcrl-slurm/etc/slurm.conf"
    finally:
        subprocess.run([str(tool), "down"], check=False, timeout=120)


@pytest.fixture
def slurm_cluster(_slurm_up, monkeypatch):
    """The session's Slurm cluster, seen (``SLURM_CONF``) only by the test that asks for it: ``hpcrl plan``
    and ``render`` ask any Slurm they see (``sbatch --test-only``), and the test cluster would refuse
    the other tests' partitions and node shapes."""
    monkeypatch.setenv("SLURM_CONF", _slurm_up)
    return _slurm_up


# -- one torchrun per world size, shared by the test modules that build trainers -----------------------
@dataclass(frozen=True)
class TorchrunCase:
    """One case of tests/harness/recipe_build.py: a trainer built on a session checkpoint (``checkpoint``, made
    by ``make`` on first use) from ``overrides`` at ``world`` ranks. ``record``: what rank 0 writes back:
    "build" (the step's metrics and the layout the ranks ran), "parity" (what tests/harness/megatron_parity.py
    saves: log-probs, metrics, full gradients and weights, each rank's optimizer state after a
    checkpoint round trip, the layout) or "mixer" (tests/harness/mamba_mixer_check.py's comparison).
    ``plan``: apply the planner's quirks first, as a job does. ``last``: a case expected to fail.
    ``env``: variables its torchrun starts with (cases that differ in them run in torchruns of their own)."""

    id: str
    module: str
    world: int
    backend: str
    overrides: tuple[str, ...]
    checkpoint: str
    make: Callable[[Path], object]
    record: str = "build"
    plan: bool = True
    last: bool = False
    env: tuple[tuple[str, str], ...] = ()


TORCHRUN_CASES: dict[str, TorchrunCase] = {}
"""Registered by the test modules at import, so that each world size's torchrun serves them all."""


def register_torchrun_case(case: TorchrunCase) -> TorchrunCase:
    assert TORCHRUN_CASES.setdefault(case.id, case) == case, f"two torchrun cases named {case.id}"
    return case


def _case_order(case: TorchrunCase) -> tuple:
    # fsdp's cases before Megatron's (whose CPU shims patch torch for the whole process), a case
    # expected to fail last
    return (case.world, case.backend != "fsdp", case.last, case.id)


def _run_of(case: TorchrunCase) -> tuple:
    """Cases that share a torchrun: the same world size and environment."""
    return (case.world, case.env)


class TorchrunCases:
    """A registered case's result: on first use, every pending case of its world size and environment
    (of the modules this session runs) in one torchrun; a case that ended a run gets its output as ``error`` and the
    cases after it run again without it."""

    def __init__(self, root: Path, modules: set[str]) -> None:
        self.root, self.modules = root, modules
        self.results: dict[str, dict[str, Any]] = {}

    def checkpoint(self, name: str) -> Path:
        path = self.root / "checkpoints" / name
        if not path.exists():
            next(c for c in TORCHRUN_CASES.values() if c.checkpoint == name).make(path)
        return path

    def result(self, case_id: str) -> dict[str, Any]:
        if case_id not in self.results:
            run = _run_of(TORCHRUN_CASES[case_id])
            todo = sorted(
                (
                    c
                    for c in TORCHRUN_CASES.values()
                    if _run_of(c) == run
                    and c.id not in self.results
                    and (c.module in self.modules or c.id == case_id)
                ),
                key=_case_order,
            )
            while todo:
                done, error = self._torchrun(todo)
                self.results |= done
                todo = [c for c in todo if c.id not in self.results]
                if todo:
                    self.results[todo.pop(0).id] = {"error": error or "no result written"}
        return self.results[case_id]

    def _torchrun(self, cases: list[TorchrunCase]) -> tuple[dict[str, dict[str, Any]], str]:
        import torch

        from hpcrl.trainer.process_group import free_port
        from tests.harness.zygote import torchrun

        out = self.root / f"run{len(list(self.root.glob('run*')))}"
        out.mkdir()
        spec = [
            {
                "id": c.id,
                "model_dir": str(self.checkpoint(c.checkpoint)),
                "overrides": list(c.overrides),
                "record": c.record,
                "plan": c.plan,
            }
            for c in cases
        ]
        (out / "cases.json").write_text(json.dumps(spec))
        script, args = ROOT / "tests" / "harness" / "recipe_build.py", [str(out / "cases.json"), str(out)]
        try:  # a hung case ends the run on its own (recipe_build.py's per-case watchdog)
            done = torchrun(
                script,
                args,
                cases[0].world,
                free_port(),
                timeout=300 + 300 * len(cases),
                start_env=dict(cases[0].env),
            )
            error = "" if done.returncode == 0 else (done.stdout + done.stderr)[-6000:]
        except subprocess.TimeoutExpired as exc:
            error = f"torchrun timed out after {exc.timeout} s"
        results = {}
        for c in cases:
            if (path := out / f"{c.id}.json").exists():
                results[c.id] = json.loads(path.read_text())
            elif (path := out / f"{c.id}.pt").exists():
                results[c.id] = torch.load(path)
        return results, error


@pytest.fixture(scope="session")
def torchrun_cases(request, tmp_path_factory):
    """The registered torchrun cases' results (tests/harness/recipe_build.py), one torchrun per world size
    (and environment)."""
    modules = {item.module.__name__ for item in request.session.items if getattr(item, "module", None)}
    return TorchrunCases(tmp_path_factory.mktemp("torchrun"), modules)
