"""Build a recipe's training backend on a tiny checkpoint and run one step on the parity batch, case
after case, under torchrun (gloo, CPU); rank 0 writes OUT/<id>.json: the step's metrics and the
layout the ranks really ran (Megatron's process groups, or fsdp's world).

    python -m torch.distributed.run --nproc_per_node N tests/recipe_build.py CASES.json OUT

CASES.json lists {"id", "model_dir", "overrides"} cases of one backend at world size N. They share
the processes (torch, transformers and Megatron imported once); Megatron's parallel state is torn
down between cases. A case that fails or hangs (HPCRL_RECIPE_CASE_S, default 240 s: every stack is
printed) ends the run; the caller finds it as the first case without a result.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron_parity import parity_batch  # beside this script (sys.path[0])

from hpcrl.config.compose import compose_config
from hpcrl.plan.planner import make_plan


def run_case(case: dict[str, Any], rank: int, world: int, master: str) -> dict[str, Any]:
    from hpcrl.trainer import make_trainer

    cfg = compose_config(case["overrides"])
    make_plan(cfg)  # the model's quirks, applied in place as the job's resolved config has them
    trainer: Any = make_trainer(Path(case["model_dir"]), cfg, rank, world, master, "cpu")
    batch = parity_batch()
    ref = trainer.logprobs(batch, reference=True) if cfg.algo.kl_coef > 0 else None
    metrics = trainer.train_step(batch, ref)
    layout = ran_layout(trainer, world)
    del trainer
    gc.collect()
    if cfg.trainer.backend == "megatron":
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
    return {"metrics": metrics, "layout": layout}


def ran_layout(trainer: Any, world: int) -> dict[str, Any]:
    """What the ranks ran: Megatron's groups as built (not as asked), fsdp's data-parallel world."""
    if not hasattr(trainer, "ps"):
        return {"dp": dist.get_world_size()}
    ps = trainer.ps
    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "cp": ps.get_context_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "expert_tp": ps.get_expert_tensor_parallel_world_size(),
        "sequence_parallel": bool(trainer.model.config.sequence_parallel),
    }


def main() -> None:
    cases, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    master = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    for case in cases:
        faulthandler.dump_traceback_later(float(os.environ.get("HPCRL_RECIPE_CASE_S", 240)), exit=True)
        started = time.perf_counter()
        result = run_case(case, rank, world, master)
        dist.barrier()  # every rank stepped: only then does the case count as built
        faulthandler.cancel_dump_traceback_later()
        result["seconds"] = round(time.perf_counter() - started, 1)
        if rank == 0:
            (out / f"{case['id']}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
