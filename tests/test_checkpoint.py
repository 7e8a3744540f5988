"""Checkpoints: atomic writes, keep-top-k by metric, the latest kept for resume."""

from __future__ import annotations

from hpcrl.run.checkpoint import CheckpointManager, load_state


def test_keep_top_k_plus_latest(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_top_k=2, metric="val/accuracy", higher_is_better=True)
    for step, acc in [(10, 0.5), (20, 0.9), (30, 0.7), (40, 0.2)]:
        mgr.save(step, {"step": step}, {"val/accuracy": acc})
    steps = sorted(c.step for c in mgr.list())
    assert steps == [20, 30, 40]  # the two best (20, 30) and the latest (40)
    assert mgr.best().step == 20
    assert mgr.latest().step == 40
    assert load_state(mgr.latest())["step"] == 40


def test_lower_is_better(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_top_k=1, metric="loss", higher_is_better=False)
    for step, loss in [(1, 0.3), (2, 0.1), (3, 0.2)]:
        mgr.save(step, {}, {"loss": loss})
    assert sorted(c.step for c in mgr.list()) == [2, 3]


def test_interrupted_write_is_never_resumed(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_top_k=3, metric="m", higher_is_better=True)
    mgr.save(1, {"step": 1}, {"m": 1.0})
    # a kill during the write of step 2 leaves only the temporary directory behind
    partial = tmp_path / "step_000002.tmp"
    partial.mkdir()
    (partial / "state.pt").write_bytes(b"truncated")
    assert mgr.latest().step == 1
    mgr.save(3, {"step": 3}, {"m": 0.5})  # the next save clears the leftover
    assert not partial.exists() and mgr.latest().step == 3
