"""Training backends (fsdp, megatron). Importing this package does not import torch."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpcrl.trainer.base import Trainer


def make_trainer(model_dir: Path, cfg: Any, rank: int, world: int, master: str, device: str) -> Trainer:
    """The backend the ``trainer`` config group chose, built on this rank."""
    if cfg.trainer.backend == "megatron":
        from hpcrl.trainer.megatron import MegatronTrainer

        return MegatronTrainer(model_dir, cfg, rank=rank, world=world, master=master, device=device)
    from hpcrl.trainer.fsdp import FSDPTrainer

    return FSDPTrainer(model_dir, cfg, rank=rank, world=world, master=master, device=device)
