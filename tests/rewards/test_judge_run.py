"""The judge recipe end to end through `hpcrl submit` (local Ray, vLLM CPU for the policy and for the
judge, FSDP2 gloo): every step's samples go to the judge engine in one batch, the replies the tiny
judge cannot be read as a number are counted, the step's time split is logged, and the judge's weights
are those it started with after the policy's refits. The tiny judge's scores mean nothing: asserted is
the plumbing, not the judgement."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.slow


def test_the_judge_recipe_scores_every_sample_with_a_frozen_judge(tmp_path, model_cache, monkeypatch):
    monkeypatch.setenv("HPCRL_CACHE", str(model_cache))
    result = run_cli(
        "submit",
        "+experiment=grpo-tiny-1n1g-fsdp-judge",
        f"run.output_root={tmp_path}",
        "algo.max_steps=3",
        "algo.val_period=3",
        "algo.num_prompts_per_step=8",
        "checkpoint.enabled=false",
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/reward" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert r["judge/batches"] == 1  # the whole step in one batch
        assert r["judge/samples"] == 8 * 8  # prompts x generations (validation's are not the step's)
        assert 0 <= r["judge/parse_failures"] <= r["judge/samples"]
        assert 0 <= r["judge/mean_score"] <= 1
        assert r["time/judge"] > 0 and r["time/generate"] > 0 and r["time/train"] > 0
        # the batch's time is generation's and the judge's (no environment in this recipe)
        assert r["time/generate"] + r["time/judge"] == pytest.approx(r["time/rollout"], abs=1e-6)
    # parsed or not, every reply was read: over three steps the tiny judge both answers and babbles
    assert sum(r["judge/parse_failures"] for r in steps) < sum(r["judge/samples"] for r in steps)
    judge = json.loads((run_dir / "judge.json").read_text())
    assert judge["model"] == "tiny" and [e["role"] for e in judge["engines"]] == ["judge"]
    assert judge["weights_unchanged"] is True  # three refits of the policy's engine, none of the judge's
