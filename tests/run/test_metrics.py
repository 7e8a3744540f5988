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
