"""How much host memory building the Megatron trainer (its model, loaded from the checkpoint) takes on
each rank, against the bytes of the model part the rank holds; run under torchrun (gloo, CPU), rank 0
saves every rank's numbers (MB) as JSON.

    python -m torch.distributed.run --nproc_per_node N tests/harness/megatron_load_memory.py MODEL_DIR OUT TP PP

The growth is the resident set's high-water mark (VmHWM, reset by writing 5 to /proc/self/clear_refs)
over the resident set before the build: what a rank really held at its peak, file-mapped pages too.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import torch
from megatron_parity import overrides  # beside this script: torchrun runs it as a file

from hpcrl.config.compose import compose_config

MB = 1 << 20


def status(key: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024


def main() -> None:
    model_dir, out, tp, pp = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)
    # imported (and the config read) before measuring: their code is not what is measured
    from megatron.core.models.gpt import GPTModel  # noqa: F401

    from hpcrl.trainer import make_trainer
    from hpcrl.trainer.megatron.spec import family_of, text_config

    family_of(text_config(model_dir))

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    master = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    cfg = compose_config(
        [o for o in overrides(tp, pp) if not o.startswith("algo.kl_coef")] + ["algo.kl_coef=0"]
    )
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = status("VmRSS")
    trainer = make_trainer(model_dir, cfg, rank, world, master, "cpu")
    grown = status("VmHWM") - before
    held = sum(t.numel() * t.element_size() for _, t in trainer.placement.loaded(trainer.model))
    numbers = {"rank": rank, "grown_mb": grown / MB, "held_mb": held / MB}
    every: list = [None] * world
    torch.distributed.all_gather_object(every, numbers)
    if rank == 0:
        out.write_text(json.dumps(every))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
