"""Multi-turn episodes end to end through `hpcrl submit` (local Ray, vLLM CPU, FSDP2 gloo): the
calculator recipe with a scripted environment that always runs to the turn limit, so every episode is
multi-turn, on the overlapped loop (max_staleness 1: generation in a thread beside training). One run
(~2 min on 2 cores): the on-policy loop reaches the episodes by the same call (``loop.collect``)."""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.slow


def test_the_recipe_trains_on_multi_turn_episodes(tmp_path, model_cache, monkeypatch):
    monkeypatch.setenv("HPCRL_CACHE", str(model_cache))
    monkeypatch.setenv("HPCRL_PLUGINS", "tests.harness.env_plugins")
    result = run_cli(
        "submit",
        "+experiment=grpo-tiny-1n1g-fsdp-calculator",
        f"run.output_root={tmp_path}",
        "env.name=test_scripted",
        "env.max_turns=3",
        "algo.max_steps=2",
        "algo.val_period=2",
        "algo.num_prompts_per_step=8",
        "checkpoint.enabled=false",
        "algo.max_staleness=1",
        "algo.is_correction=tis",
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (run_dir,) = tmp_path.iterdir()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/gen_kl_error" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        # three model turns of up to 8 tokens and two observations: longer than one turn can be
        assert r["train/mean_gen_tokens"] > 8
        assert r["train/reward"] == pytest.approx(0.25)  # the scripted environment's grade
        # the trainer's log-probs of the model's tokens are the engine's: the mask and ids line up
        assert r["train/gen_kl_error"] < 1e-4
        # the environments' share of the batch: within the generation that waited on them
        assert 0 < r["time/environment"] < r["time/generate"]
    assert os.path.exists(run_dir / "samples.jsonl")
