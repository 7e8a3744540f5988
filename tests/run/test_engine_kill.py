"""Rollout engines SIGKILLed (or SIGSTOPped: hung) mid-generation in the real loop (local Ray, vLLM
CPU engines, the FSDP2 trainer; tests/harness/engine_kill.py): the run goes on, the metrics count the
restart, and every sample carries the version of the weights the trainers held when its batch began
(the scheduling itself without Ray: tests/run/test_engine_faults.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

SMALL = [
    "algo.max_steps=4",
    "algo.num_prompts_per_step=8",
    "algo.num_generations=4",
    "rollout.max_num_seqs=4",  # one group at a time: the killed engine has prompts still to come
    "algo.val_at_start=false",
    "algo.val_period=100",
    "checkpoint.period=100",
]


def killed_run(tmp_path, cache, engines: int, kills: str, *overrides: str):
    env = {**os.environ, "HPCRL_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    args = [sys.executable, str(ROOT / "tests/harness/engine_kill.py"), str(tmp_path), str(engines), kills]
    result = subprocess.run(
        [*args, *SMALL, *overrides], capture_output=True, text=True, env=env, cwd=ROOT, timeout=900
    )
    calls = json.loads((tmp_path / "calls.json").read_text())
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return result, calls, rows


def versions_right(calls: list[dict]) -> None:
    """Every completion of a call was made by the weights the trainers held when it began."""
    for call in calls:
        v = call["version"]
        assert call["versions"] and {tuple(x) for x in call["versions"]} == {(v, v)}, call


def test_one_engine_on_policy_is_rebuilt_mid_batch_and_past_the_bound_the_run_saves_and_stops(
    tmp_path, model_cache
):
    """The lone engine dies generating step 2's batch: it comes back at once (nothing else could
    finish the batch) with the trainers' weights. It dies again while step 3 trains: rebuilt before
    that step's refit. Generating step 4's batch is one failure past the bound."""
    result, calls, rows = killed_run(tmp_path, model_cache, 1, "2,t3,4", "rollout.max_engine_restarts=2")
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert [c["killed"] for c in calls] == [None, 0, None, 0]
    versions_right(calls[:3])  # the fourth call ended with the run
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["faults/engine_restarts"] for r in rows] == [0.0, 1.0, 1.0]
    assert rows[1]["faults/lost_groups"] >= 1 and rows[2]["faults/lost_groups"] == 0
    assert "engine restarts 1, lost groups" in result.stdout
    # the rebuilt engine generates with the trainers' weights, not vLLM's dummy ones
    assert all(abs(r["train/gen_kl_error"]) < 1e-4 for r in rows)
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("hpcrl: error:")]
    assert "rollout engine 0 on " in line and "ActorDiedError" in line
    assert line.endswith(
        "more than rollout.max_engine_restarts=2: stopped after saving step 3; submit again to resume"
    )
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_000003"]


def test_two_engines_off_policy_the_survivor_finishes_the_batch_and_the_dead_one_comes_back(
    tmp_path, model_cache
):
    """Generation one step ahead (the producer thread): one of two engines dies making batch 3; the
    other takes its unfinished prompts, the refit after step 2 rebuilds it, and batch 4 is made by
    both, at the new version. Making batch 4 one of them hangs (SIGSTOP): killed after
    ``rollout.hang_timeout_s``, the same again."""
    result, calls, rows = killed_run(
        tmp_path,
        model_cache,
        2,
        "3,s4",
        "algo.max_staleness=1",
        "algo.is_correction=tis",
        "rollout.hang_timeout_s=20",  # a group of this run takes well under a second
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert [c["version"] for c in calls] == [0, 0, 1, 2]
    assert calls[2]["killed"] is not None and calls[3]["killed"] is not None
    versions_right(calls)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert sum(r["faults/engine_restarts"] for r in rows) == 2.0
    assert sum(r["faults/lost_groups"] for r in rows) >= 2
    assert [r["async/staleness"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
