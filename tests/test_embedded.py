"""The embedded default end to end (`hpcrl submit` with no cluster), and exact resume.

Real parts only: local Ray, the vLLM CPU engine, math-verify workers, the FSDP2 trainer.
"""

from __future__ import annotations

import json
import os

import pytest

from .conftest import run_cli

pytestmark = pytest.mark.slow


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def submit(tmp_path, cache, *overrides):
    env_cache = os.environ.get("HPCRL_CACHE")
    os.environ["HPCRL_CACHE"] = str(cache)
    try:
        return run_cli("submit", f"run.output_root={tmp_path}", *overrides, timeout=600)
    finally:
        if env_cache is None:
            os.environ.pop("HPCRL_CACHE")
        else:
            os.environ["HPCRL_CACHE"] = env_cache


def test_embedded_default_learns(tmp_path):
    """From an empty model cache: the tiny model is built, trained with GRPO, and validation rises."""
    result = submit(tmp_path / "runs", tmp_path / "cache")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    rows = metrics(run_dir)
    val = [r["val/accuracy"] for r in rows if "val/accuracy" in r]
    assert val[-1] - val[0] >= 0.20, val
    last = rows[-1]
    assert last["step"] == 30 and last["train/gen_kl_error"] < 1e-4  # engine and trainer agree
    assert {
        "time/rollout",
        "time/train",
        "time/weight_sync",
        "perf/gen_tokens_per_s",
        "train/entropy",
    } <= set(last)
    assert list((run_dir / "tensorboard").iterdir())
    assert (run_dir / "checkpoints" / "step_000030" / "state.pt").exists()
    assert "validation accuracy" in result.stdout and str(run_dir / "metrics.jsonl") in result.stdout


def test_resume_continues_the_same_trajectory(tmp_path):
    cache = tmp_path / "cache"
    small = ["algo.num_prompts_per_step=16", "algo.val_period=100", "algo.val_at_start=false",
             "checkpoint.period=2"]  # fmt: skip
    straight = tmp_path / "straight"
    assert submit(tmp_path, cache, *small, "algo.max_steps=4", f"run.dir={straight}").returncode == 0
    resumed = tmp_path / "resumed"
    first = submit(tmp_path, cache, *small, "algo.max_steps=2", f"run.dir={resumed}")
    assert first.returncode == 0
    second = submit(tmp_path, cache, *small, "algo.max_steps=4", f"run.dir={resumed}")
    assert second.returncode == 0 and "resumed from" in second.stdout
    a = {r["step"]: r for r in metrics(straight)}
    b = {r["step"]: r for r in metrics(resumed)}
    for step in (3, 4):
        assert b[step]["train/reward"] == a[step]["train/reward"]
        assert b[step]["train/loss"] == pytest.approx(a[step]["train/loss"], abs=1e-6)


def test_megatron_backend_runs_the_loop_and_feeds_the_engine_exact_weights(tmp_path):
    """trainer=megatron in the real loop: vLLM reloads the exported (HF-named) weights after every step,
    here through Ray's object store (the other runs of this file broadcast them over gloo)."""
    result = submit(tmp_path / "runs", tmp_path / "cache", "trainer=megatron", "algo.max_steps=6",
                    "algo.val_period=3", "checkpoint.period=3", "rollout.weight_sync=object_store")  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    rows = metrics(run_dir)
    assert rows[-1]["step"] == 6
    assert all(r["train/gen_kl_error"] < 1e-4 for r in rows if "train/gen_kl_error" in r)
    val = [r["val/accuracy"] for r in rows if "val/accuracy" in r]
    assert val[-1] > val[0], val
    assert (run_dir / "checkpoints" / "step_000006" / "state.pt").exists()


def test_dapo_runs_the_loop_with_dynamic_sampling_and_overlong_shaping(tmp_path):
    """algo=dapo over the embedded default: groups whose rewards are all equal are dropped and more
    prompts are sampled (up to the round limit); the overlong penalty and clip-higher are in the loss."""
    result = submit(tmp_path / "runs", tmp_path / "cache", "algo=dapo", "algo.overlong_buffer=2",
                    "algo.lr=3e-4", "algo.max_steps=4", "algo.val_period=4", "algo.num_prompts_per_step=32",
                    "algo.num_generations=8")  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    rows = [r for r in metrics(run_dir) if "train/kept_groups" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        # sampling stops early only once the step has its 32 informative groups; a short step used all 3 rounds
        if r["train/kept_groups"] < 32:
            assert r["train/dynamic_sampling_rounds"] == 3, r
        else:
            assert r["train/dynamic_sampling_rounds"] in (1, 2, 3), r
        # only informative groups are kept, never more than the step asks for
        assert 0 < r["train/kept_groups"] <= 32
    assert any(r["train/dynamic_sampling_rounds"] > 1 or r["train/kept_groups"] < 32 for r in rows)
