"""The trainer interface the driver's actors call (``Trainer``: fsdp.py and megatron/ implement it),
and what both backends do alike to a freshly loaded model (``freeze``). The training step they share
is step.py's."""

from __future__ import annotations

from typing import Protocol

import torch

from hpcrl.trainer.batch import TrainBatch


class Trainer(Protocol):
    def data_rank(self) -> tuple[int, int]:
        """(data-parallel rank, data-parallel size): which shard of the batch this rank trains on."""
        ...

    def logprobs(self, batch: TrainBatch, reference: bool = False) -> torch.Tensor:
        """[B, T-1] log-probabilities of the target tokens, under the policy or the frozen reference."""
        ...

    def train_step(self, batch: TrainBatch, ref_logp: torch.Tensor | None) -> dict[str, float]:
        """One optimizer step per minibatch over ``batch``; returns loss/KL/grad-norm/entropy metrics."""
        ...

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Full (gathered) weights under Hugging Face names, for the rollout engines."""
        ...

    def save_checkpoint(self, path: str, async_save: bool) -> float:
        """This rank's weights and optimizer state into the checkpoint directory ``path`` (shared by
        every rank; trainer/shards.py); async: copied to host memory, written in the background.
        Returns the seconds the call blocked."""
        ...

    def finish_checkpoint(self) -> float:
        """Wait for this rank's async save to be on disk; the seconds waited."""
        ...

    def load_checkpoint(self, path: str, weights_only: bool = False) -> None:
        """Weights (and optimizer state) from a checkpoint this backend wrote under any layout."""
        ...


def freeze(model: torch.nn.Module, names: list[str]) -> None:
    """``trainer.freeze``: parameters whose name contains any of ``names`` get no gradient."""
    for name in names:
        for pname, param in model.named_parameters():
            if name in pname:
                param.requires_grad_(False)
