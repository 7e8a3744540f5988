"""The learning rate at each step (``algo.lr_schedule``): a pure function of the step, so a resumed run
takes up the schedule where it stopped with nothing to restore. The driver computes it for the step
it trains and the trainer ranks set it on their optimizers (every minibatch of a step shares it)."""

from __future__ import annotations

import math

from hpcrl.algo.config import AlgoConfig, LRSchedule


def lr_at(algo: AlgoConfig, step: int) -> float:
    """The rate of step ``step`` (1 = the first trained): a linear warmup over ``lr_warmup_steps``,
    then constant, or a linear or cosine decay reaching ``lr_min`` at ``max_steps``."""
    warmup = algo.lr_warmup_steps
    if step <= warmup:
        return algo.lr * step / warmup
    if algo.lr_schedule is LRSchedule.constant:
        return algo.lr
    progress = min(1.0, (step - warmup) / max(1, algo.max_steps - warmup))
    left = (
        1.0 - progress
        if algo.lr_schedule is LRSchedule.linear
        else 0.5 * (1.0 + math.cos(math.pi * progress))
    )
    return algo.lr_min + (algo.lr - algo.lr_min) * left
