"""DAPO reward shaping and sample filters: overlong punishment and filtering, reward scaling,
dynamic sampling (keep only groups whose rewards differ)."""

from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO soft overlong punishment, added to the reward.

    0 up to max_len - buffer; then falls linearly to -penalty at max_len (and stays there beyond).
    """
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    start = max_len - buffer
    over = (lengths.float() - start).clamp(min=0.0, max=float(buffer))
    return -penalty * over / buffer


def truncation_mask(truncated: torch.Tensor) -> torch.Tensor:
    """Overlong filtering: 1.0 for samples that ended by themselves, 0.0 for truncated ones."""
    return (~truncated.bool()).float()


def scale_rewards(rewards: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Clamp rewards to [low, high] and map them linearly onto [0, 1]."""
    return (rewards.clamp(low, high) - low) / (high - low)


def informative_groups(rewards: torch.Tensor, atol: float = 1e-6) -> torch.Tensor:
    """Dynamic sampling: True for groups (rows of [groups, n]) whose rewards are not all equal."""
    return (rewards.max(dim=1).values - rewards.min(dim=1).values) > atol
