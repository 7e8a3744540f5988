"""The embedded default end to end (`hpcrl submit` with no cluster), and exact resume.

Real parts only: local Ray, the vLLM CPU engine, math-verify workers, the FSDP2 trainer. The first
run builds the warm-started tiny model from an empty cache (the session's ``model_cache``); the
others reuse it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT, run_cli

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


def test_embedded_default_learns(tmp_path, model_cache):
    """From an empty model cache: the tiny model is built, trained with GRPO, and validation rises.
    The session's cache while it is empty (the later runs reuse the model), else one of its own."""
    cache = model_cache if not any(model_cache.iterdir()) else tmp_path / "cache"
    result = submit(tmp_path / "runs", cache)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "tiny model ready in" in result.stdout  # built by this run
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
    assert (run_dir / "checkpoints" / "step_000030" / "meta.json").exists()  # committed
    assert "validation accuracy" in result.stdout and str(run_dir / "metrics.jsonl") in result.stdout


def test_warning_signal_saves_the_current_step_and_resume_continues_the_same_trajectory(
    tmp_path, model_cache
):
    """SIGUSR2 (Slurm's time-limit/preemption warning) mid-run: the run checkpoints the step it
    is in — although no checkpoint is due — and stops with exit code 75; running again with the same
    run.dir resumes there, and steps after it equal an uninterrupted run's."""
    cache = model_cache
    small = [
        "algo.num_prompts_per_step=16",
        "algo.val_period=100",
        "algo.val_at_start=false",
        "algo.max_steps=4",
    ]
    straight = tmp_path / "straight"
    assert submit(tmp_path, cache, *small, "checkpoint.period=2", f"run.dir={straight}").returncode == 0
    resumed = tmp_path / "resumed"
    exe = Path(sys.executable).with_name("hpcrl")
    env = {**os.environ, "HPCRL_CACHE": str(cache), "COLUMNS": "200"}
    args = [
        str(exe),
        "submit",
        f"run.output_root={tmp_path}",
        *small,
        "checkpoint.period=100",
        f"run.dir={resumed}",
    ]
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )
    seen = []
    for line in proc.stdout:  # type: ignore[union-attr]
        seen.append(line)
        if "step   1/4" in line:
            proc.send_signal(signal.SIGUSR2)  # step 2 is running now
            break
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 75, "".join(seen) + out + err[-3000:]
    stopped = int(re.search(r"stopped after step (\d+)", err).group(1))
    # the loop reads the request before printing a step's line: a signal sent on step 1's line is
    # taken at the end of step 2
    assert stopped == 2 and f"run.dir={resumed}" in err
    saved = sorted(p.name for p in (resumed / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert saved == [f"step_{stopped:06d}"]  # only the one the signal asked for (period is 100)
    second = submit(tmp_path, cache, *small, f"run.dir={resumed}")
    assert second.returncode == 0 and f"(step {stopped})" in second.stdout, second.stdout[-2000:]
    a = {r["step"]: r for r in metrics(straight)}
    b = {r["step"]: r for r in metrics(resumed)}
    for step in range(stopped + 1, 5):
        assert b[step]["train/reward"] == a[step]["train/reward"]


def test_megatron_backend_runs_the_loop_and_feeds_the_engine_exact_weights(tmp_path, model_cache):
    """trainer=megatron in the real loop: vLLM reloads the exported (HF-named) weights after every step,
    here through Ray's object store (the other runs of this file broadcast them over gloo)."""
    result = submit(
        tmp_path / "runs",
        model_cache,
        "trainer=megatron",
        "algo.max_steps=6",
        "algo.val_period=3",
        "checkpoint.period=3",
        "rollout.weight_sync=object_store",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    rows = metrics(run_dir)
    assert rows[-1]["step"] == 6
    assert all(r["train/gen_kl_error"] < 1e-4 for r in rows if "train/gen_kl_error" in r)
    val = [r["val/accuracy"] for r in rows if "val/accuracy" in r]
    assert val[-1] > val[0], val
    assert (run_dir / "checkpoints" / "step_000006" / "meta.json").exists()  # committed


def test_dapo_runs_the_loop_with_dynamic_sampling_and_overlong_shaping(tmp_path, model_cache):
    """algo=dapo over the embedded default: groups whose rewards are all equal are dropped and more
    prompts are sampled (up to the round limit); the overlong penalty and clip-higher are in the loss."""
    result = submit(
        tmp_path / "runs",
        model_cache,
        "algo=dapo",
        "algo.overlong_buffer=2",
        "algo.lr=3e-4",
        "algo.max_steps=4",
        "algo.val_period=4",
        "algo.num_prompts_per_step=32",
        "algo.num_generations=8",
    )
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
