"""The built-in arithmetic task: 'a+b=' / 'a-b=' problems with integer answers, no download.

Problems are generated from a seed, so the train/validation split is the same on every run.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


def make_problem(rng: random.Random, max_operand: int = 19) -> Problem:
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    if rng.random() < 0.5:
        return Problem(f"{a}+{b}=", str(a + b))
    return Problem(f"{a}-{b}=", str(a - b))


def synthetic_split(
    num_train: int, num_val: int, seed: int = 0, max_operand: int = 19
) -> tuple[list[Problem], list[Problem]]:
    """Disjoint train and validation problems (validation prompts never appear in training)."""
    rng = random.Random(seed)
    seen: set[str] = set()
    val: list[Problem] = []
    while len(val) < num_val:
        p = make_problem(rng, max_operand)
        if p.prompt not in seen:
            seen.add(p.prompt)
            val.append(p)
    train: list[Problem] = []
    while len(train) < num_train:
        p = make_problem(rng, max_operand)
        if p.prompt not in seen:
            train.append(p)
    return train, val
