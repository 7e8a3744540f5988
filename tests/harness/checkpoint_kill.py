"""A two-rank fsdp run whose rank 1 is killed while writing a checkpoint, and the resume after it.

    python -m torch.distributed.run --nproc_per_node 2 tests/harness/checkpoint_kill.py MODEL_DIR RUN_DIR die|resume

die: step 1 is saved and committed (rank 0 plays the driver: run/checkpoint.py's manager); after
step 2 an async save starts and rank 1 SIGKILLs itself in the middle of writing its shard file, so
torchrun tears the run down before the manager can commit. resume: both ranks load the latest
committed checkpoint; rank 0 writes what it loaded to RUN_DIR/resumed.pt.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpcrl.config.compose import compose_config
from hpcrl.run.checkpoint import CheckpointManager
from hpcrl.trainer.fsdp import FSDPTrainer

sys.path.insert(0, str(Path(__file__).parent))
from megatron_parity import parity_batch as batch


class SyncedShards:
    """The trainer as the manager's ``Shards``, every rank at once (rank 0 prepared the directory)."""

    def __init__(self, trainer: FSDPTrainer) -> None:
        self.trainer = trainer

    def save_checkpoint(self, path: str, async_save: bool) -> float:
        dist.barrier()
        return self.trainer.save_checkpoint(path, async_save)

    def finish_checkpoint(self) -> float:
        # every rank's write done before rank 0 commits, as the driver's fleet waits on all ranks; without
        # it rank 0 could rename step 1's directory under rank 1's last file (seen under load)
        waited = self.trainer.finish_checkpoint()
        dist.barrier()
        return waited


def die_while_writing() -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    def write_data(self: Any, plan: Any, planner: Any) -> Any:
        (Path(self.path) / f"__{dist.get_rank()}_0.distcp").write_bytes(b"half a shard")
        os.kill(os.getpid(), signal.SIGKILL)

    FileSystemWriter.write_data = write_data  # type: ignore[method-assign]


def main() -> None:
    model_dir, run_dir, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    master = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    cfg = compose_config(["model=tiny", "algo.kl_coef=0", "algo.lr=1e-3"])
    trainer = FSDPTrainer(model_dir, cfg, rank=rank, world=world, master=master)
    root = run_dir / "checkpoints"
    ckpt = CheckpointManager(root, 3, "m", True, about={"backend": "fsdp"}) if rank == 0 else None
    if mode == "resume":
        latest = CheckpointManager(root, 3, "m", True).latest()
        assert latest is not None
        trainer.load_checkpoint(str(latest.path / "trainer"))
        weights = trainer.export_weights()
        if rank == 0:
            torch.save({"step": latest.step, "weights": weights}, run_dir / "resumed.pt")
        return
    shards = SyncedShards(trainer)
    for step in (1, 2):
        trainer.train_step(batch())
        weights = trainer.export_weights()
        if rank == 0:
            torch.save(weights, run_dir / f"step{step}.pt")
        if step == 2 and rank == 1:
            die_while_writing()
        if ckpt is not None:
            ckpt.save(step, shards, {"step": step}, {"m": float(step)}, async_save=True)
            ckpt.settle(shards)  # step 2: waits on a save that rank 1 never finishes
        else:
            shards.save_checkpoint(str(root / f"step_{step:06d}.tmp" / "trainer"), async_save=True)
            shards.finish_checkpoint()


if __name__ == "__main__":
    main()
