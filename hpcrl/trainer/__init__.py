"""Training backends, picked by the ``trainer`` config group (``make_trainer``). Importing this
package does not import torch.

base.py          the Trainer interface the driver's actors call
step.py          the training step, once for every backend (minibatches, micro-batches, PolicyLoss)
fsdp/            the FSDP2 backend over a Hugging Face model
megatron/        the Megatron-core backend (TP/PP/CP/EP)
logprob_head.py  log-probs and entropy from hidden states in chunks, never the full logits
batch.py         the batch the driver hands a trainer
config.py        the trainer schemas (torch-free: the planner reads them)
backends.py      the backend table: each backend's spec (torch-free)
process_group.py the process-group set-up both backends share
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpcrl.core.parallel import TrainParallel
    from hpcrl.trainer.base import Trainer


def make_trainer(
    model_dir: Path,
    cfg: Any,
    rank: int,
    world: int,
    master: str,
    device: str,
    par: TrainParallel | None = None,
) -> Trainer:
    """The backend the ``trainer`` config group chose (its spec, ``trainer/backends.py``), built on this
    rank; ``par``: the plan's degrees (the job's ``Fleet``), None: ``trainer.*``'s (harnesses, benches)."""
    from hpcrl.trainer.backends import trainer_spec

    trainer: Trainer = trainer_spec(cfg.trainer).make()(
        model_dir, cfg, rank=rank, world=world, master=master, device=device, par=par
    )
    return trainer
