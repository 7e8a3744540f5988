"""Metric sinks: metrics.jsonl, TensorBoard event files and wandb in offline mode (no network)."""

from __future__ import annotations

import json

from hpcrl.config.schema import LoggerConfig
from hpcrl.run.metrics import MetricsLogger, console_line


def test_all_sinks_write(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.chdir(tmp_path)
    logger = MetricsLogger(
        tmp_path, LoggerConfig(tensorboard=True, wandb=True, wandb_mode="offline"), "t", {}
    )
    logger.log(1, {"train/reward": 0.25, "val/accuracy": 0.5})
    logger.log(2, {"train/reward": 0.5})
    shown = [{"prompt": "2+2", "completion": "4\nso 4", "answer": "4", "outcome": "correct"}]
    logger.samples(2, shown)
    logger.samples(3, [])  # val_samples=0: nothing written
    logger.close()
    assert [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()] == [
        {"step": 2, **shown[0]}
    ]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["train/reward"] == 0.5
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert list((tmp_path / "wandb").glob("offline-run-*"))


def test_console_line_shows_the_key_figures():
    line = console_line(3, 30, {"train/reward": 0.5, "val/accuracy": 0.25, "time/step": 1.5})
    assert line == "step   3/30 | reward 0.500 | val 0.250 | 1.5s"


def test_a_resume_drops_the_rows_a_killed_attempt_logged_after_its_checkpoint(tmp_path):
    import json

    from hpcrl.run.metrics import read_metrics

    first = MetricsLogger(tmp_path, LoggerConfig(tensorboard=False), "t", {})
    for step in range(5):
        first.log(step, {"train/reward": float(step)})
    first.samples(4, [{"prompt": "p", "completion": "c", "answer": "a", "outcome": "x"}])
    first.jsonl.write('{"step": 5, "train/rew')  # killed mid-line after step 5's row began
    first.jsonl.flush()
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3, 4]
    second = MetricsLogger(tmp_path, LoggerConfig(tensorboard=False), "t", {})
    second.resume(2)  # the last checkpoint was step 2: steps 3 and 4 run again
    for step in (3, 4, 5):
        second.log(step, {"train/reward": 10.0 + step})
    second.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert [r["train/reward"] for r in rows[3:]] == [13.0, 14.0, 15.0]
    assert (tmp_path / "samples.jsonl").read_text() == ""  # step 4's samples are the killed attempt's
    third = MetricsLogger(tmp_path, LoggerConfig(tensorboard=False), "t", {})
    third.resume(0)  # no checkpoint to resume: the run starts afresh
    third.close()
    assert read_metrics(tmp_path) == []


def test_reading_a_file_with_a_resumed_attempts_repeated_steps_takes_the_later_rows(tmp_path):
    import json

    from hpcrl.run.metrics import read_metrics

    steps = [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0), (2, 20.0), (3, 30.0), (4, 40.0)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "r": r}) + "\n" for s, r in steps))
    assert [(r["step"], r["r"]) for r in read_metrics(tmp_path)] == [
        (0, 0.0),
        (1, 1.0),
        (2, 20.0),
        (3, 30.0),
        (4, 40.0),
    ]
