"""Small value checks shared by the config schemas; each raises a ConfigError naming the key."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from hpcrl.errors import ConfigError


def positive(key: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"{key}={value} must be > 0")


def non_negative(key: str, value: float) -> None:
    if value < 0:
        raise ConfigError(f"{key}={value} must be >= 0")


def in_range(key: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise ConfigError(f"{key}={value} must be between {low} and {high}")


def one_of(key: str, value: object, choices: Iterable[object]) -> None:
    options = list(choices)
    if value not in options:
        listed = ", ".join(str(c) for c in options)
        raise ConfigError(f"{key}={value} is not one of: {listed}")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


MISSING: Any = "???"
"""A required field without a default: the same sentinel as ``omegaconf.MISSING`` (which Hydra's
structured configs recognise), defined here so that loading a cached config imports no omegaconf."""
