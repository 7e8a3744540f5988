"""The trainer interface the driver's actors call (``Trainer``: fsdp.py and megatron/ implement it),
and what both backends do alike to a freshly loaded model (``freeze``). The training step they share
is step.py's."""

from __future__ import annotations

from contextlib import AbstractContextManager
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

    def train_step(self, batch: TrainBatch, lr: float | None = None) -> dict[str, float]:
        """One optimizer step per minibatch over ``batch``, this rank's shard (``data_rank``), scored
        first under the frozen reference for the KL term, at learning rate ``lr`` (None: as it is;
        ``algo/schedule.py``); returns the loss/KL/grad-norm/entropy metrics of the whole batch,
        reduced over the data-parallel ranks (the same on each)."""
        ...

    def weight_metas(self) -> list[tuple[str, tuple[int, ...]]]:
        """The Hugging Face tensors (name, full shape) this rank sends the engines, in the order
        ``stream_weights`` puts them; empty on a rank that only helps gather. From parameter
        metadata: nothing is gathered."""
        ...

    def stream_weights(self, sink: WeightSink | None, dtype: torch.dtype) -> None:
        """Every weight the engines load, one gathered tensor at a time in ``dtype``, into ``sink``
        (None: this rank sends nothing and only takes part in the gathers). A collective: every rank
        calls it, in the same dtype. No rank holds more than the tensor being gathered beside what
        the sink keeps."""
        ...

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Full weights under Hugging Face names on rank 0: for tests and small models only (the
        engines get theirs through ``stream_weights``)."""
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


class WeightSink(Protocol):
    """Where ``stream_weights`` puts the gathered tensors (hpcrl/sync/packer.py packs them into the
    buckets the engines receive)."""

    def scratch(self, numel: int) -> AbstractContextManager[None]:
        """The caller is about to hold ``numel`` elements (in the sink's dtype) of its own while it
        gathers and converts one tensor: the sink makes room first (waits for a bucket in flight)."""
        ...

    def put(self, name: str, tensor: torch.Tensor) -> None:
        """The next tensor of the agreed order (``weight_metas``), in the stream's dtype or one the
        sink casts from as it copies (a single rank skips the cast); copied out before this returns."""
        ...


class CollectSink:
    """A sink that keeps what it is given (``export_weights``; tests): the whole model, by design."""

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.dtype = dtype

    def scratch(self, numel: int) -> AbstractContextManager[None]:
        from contextlib import nullcontext

        return nullcontext()

    def put(self, name: str, tensor: torch.Tensor) -> None:
        self.weights[name] = tensor.to(self.dtype, copy=True) if self.dtype else tensor.clone()


def numel_of(shape: tuple[int, ...] | torch.Size) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def freeze(model: torch.nn.Module, names: list[str]) -> None:
    """``trainer.freeze``: parameters whose name contains any of ``names`` get no gradient."""
    for name in names:
        for pname, param in model.named_parameters():
            if name in pname:
                param.requires_grad_(False)
