"""Group-relative advantages (GRPO): each sample is scored against the other samples of its prompt."""

from __future__ import annotations

import torch

from hpcrl.algo.config import Baseline


def group_advantages(
    rewards: torch.Tensor, baseline: Baseline = Baseline.mean, std_normalize: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Advantages for ``rewards`` of shape [groups, samples_per_group].

    mean: r_i - mean(r);  loo: r_i - mean of the other n-1 rewards (= n/(n-1) * (r_i - mean)).
    With ``std_normalize`` the result is divided by the group's (unbiased) std; groups whose rewards
    are all equal get zero advantage either way.
    """
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [groups, n>=2], got {tuple(rewards.shape)}")
    n = rewards.shape[1]
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if baseline is Baseline.loo:
        centered = centered * n / (n - 1)
    if std_normalize:
        centered = centered / (rewards.std(dim=1, keepdim=True) + eps)
    return centered
