"""``algo.lr_schedule``: warmup, then constant or a linear/cosine decay to ``lr_min`` at ``max_steps``;
the checks that refuse a schedule which cannot run as written."""

from __future__ import annotations

import math

import pytest

from hpcrl.algo.config import AlgoConfig, LRSchedule
from hpcrl.algo.schedule import lr_at
from hpcrl.errors import ConfigError


def algo(**kw: object) -> AlgoConfig:
    a = AlgoConfig(name="grpo", max_steps=10, lr=1e-5)
    for key, value in kw.items():
        setattr(a, key, value)
    a.check()
    return a


def test_warmup_then_each_schedule_reaches_its_ends() -> None:
    const = algo(lr_warmup_steps=4)
    assert [lr_at(const, s) for s in (1, 2, 4, 5, 10)] == pytest.approx([2.5e-6, 5e-6, 1e-5, 1e-5, 1e-5])
    lin = algo(lr_schedule=LRSchedule.linear, lr_warmup_steps=2, lr_min=1e-6)
    assert lr_at(lin, 2) == pytest.approx(1e-5)
    assert lr_at(lin, 6) == pytest.approx(1e-6 + 9e-6 * 0.5)  # halfway from step 2 to step 10
    assert lr_at(lin, 10) == pytest.approx(1e-6)
    cos = algo(lr_schedule=LRSchedule.cosine)
    assert lr_at(cos, 5) == pytest.approx(1e-5 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(cos, 10) == pytest.approx(0.0) and lr_at(cos, 12) == pytest.approx(0.0)  # past the end: held


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"lr_warmup_steps": 10}, r"algo.lr_warmup_steps=10 leaves no step at the full rate"),
        ({"lr_schedule": LRSchedule.linear, "lr_min": 1e-4}, r"algo.lr_min=0.0001 is above algo.lr"),
        ({"lr_min": 1e-6}, r"does nothing with algo.lr_schedule=constant"),
    ],
)
def test_a_schedule_that_cannot_run_as_written_is_one_line(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        algo(**kw)
