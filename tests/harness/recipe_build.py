"""Build a training backend on a tiny checkpoint and run one step on the parity batch, case after
case, under torchrun (gloo, CPU). What rank 0 writes depends on the case's ``record``:

- "build" (tests/recipes/test_recipes_build.py): OUT/<id>.json, the step's metrics and the layout the ranks
  really ran (Megatron's process groups, or fsdp's world);
- "parity" (tests/megatron/test_megatron_nemotron_h.py): OUT/<id>.pt, what tests/harness/megatron_parity.py saves for
  one layout (log-probs, metrics, full gradients and updated weights in HF names, each rank's
  optimizer state after a checkpoint round trip, the layout as built);
- "mixer": OUT/<id>.pt, tests/harness/mamba_mixer_check.py's comparison of the Mamba-2 mixers;
- "stream": OUT/<id>.pt, tests/harness/weight_stream_check.py's measured weight stream (each sender's peak
  memory, what a receiver process got).

    python -m torch.distributed.run --nproc_per_node N tests/harness/recipe_build.py CASES.json OUT

CASES.json lists {"id", "model_dir", "overrides", "record", "plan"} cases at world size N (fsdp's
before Megatron's); "plan": apply the planner's quirks to the config first, as a job does. They
share the processes (torch, transformers and Megatron imported once); Megatron's parallel state is
torn down between cases. A case that fails or hangs (HPCRL_RECIPE_CASE_S, default 240 s: every stack
is printed) ends the run; the caller finds it as the first case without a result.
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
from mamba_mixer_check import mixer_check  # beside this script (sys.path[0])
from megatron_parity import (
    _state_round_trip,
    counting_masks,
    expert_layout,
    parity_batch,
    stepped_grads,
    with_routes,
)
from weight_stream_check import stream_check

from hpcrl.config.compose import compose_config
from hpcrl.plan.planner import make_plan


def run_case(case: dict[str, Any], rank: int, world: int, master: str, out: Path) -> dict[str, Any]:
    from hpcrl.trainer import make_trainer

    cfg = compose_config(case["overrides"])
    if case.get("plan", True):
        make_plan(cfg)  # the model's quirks, applied in place as the job's resolved config has them
    trainer: Any = make_trainer(Path(case["model_dir"]), cfg, rank, world, master, "cpu")
    record = case.get("record", "build")
    if record == "mixer":
        result = mixer_check(trainer, Path(case["model_dir"]))
    elif record == "stream":
        result = stream_check(trainer, Path(case["model_dir"]), out / case["id"])
    elif record == "parity":
        # trainer.router_replay: the parity batch with random routes (megatron_parity.with_routes)
        routes = Path(case["model_dir"]) if cfg.trainer.router_replay else None
        result = parity_step(trainer, cfg.trainer.backend, world, out / f"{case['id']}.pt", routes)
    else:
        metrics = trainer.train_step(parity_batch())
        result = {"metrics": metrics, "layout": ran_layout(trainer, world)}
    del trainer
    gc.collect()
    if cfg.trainer.backend == "megatron":
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
    return result


def parity_step(
    trainer: Any, backend: str, world: int, out: Path, routes: Path | None = None
) -> dict[str, Any]:
    """tests/harness/megatron_parity.py's run of one layout (no resume, no second step): one step on the
    parity batch with a reference pass; rank 0's copy of the full gradients and weights. A model with
    MTP layers also records them as loaded and as the refit streams them (before the step).
    ``routes``: the model's directory, to give the batch random routes for its MoE layers."""
    batch = parity_batch() if routes is None else with_routes(parity_batch(), routes)
    # shape.mtp on every pipeline stage (the block only on the last): every rank takes part
    mtp = mtp_sent(trainer) if backend == "megatron" and trainer.shape.mtp else {}
    with counting_masks() as masks:
        ref = trainer.logprobs(
            batch, reference=True
        )  # the loaded weights' log-probs (the step scores its own)
        grads = stepped_grads(trainer, backend)
        metrics = trainer.train_step(batch)
    del trainer.zero_grad  # this step's gradients only
    assert grads or dist.get_rank() != 0, "no gradients were seen before the step freed them"
    weights = trainer.export_weights()
    local = trainer.local_optimizer() if backend == "megatron" else trainer.optimizer
    held = sum(
        v.numel() for st in local.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()
    )
    # each rank's input embedding as the step left it (None where its stage has none; before the
    # checkpoint round trip, which loads one copy into both): the MTP layers' copy on the last
    # pipeline stage must stay the first stage's
    embedding = getattr(getattr(trainer.model, "embedding", None), "word_embeddings", None)
    stepped = None if embedding is None else embedding.weight.detach().cpu().clone()
    restored = _state_round_trip(trainer, local, out)
    mine = (held, restored, stepped)
    per_rank: list[Any] = [None] * world
    if world > 1:
        dist.all_gather_object(per_rank, mine)
    else:
        per_rank = [mine]
    layout = {}
    if backend == "megatron":
        mc = trainer.model.config
        layout = {
            "sequence_parallel": mc.sequence_parallel,
            "cp": mc.context_parallel_size,
            "packed_masks": masks["masks"],
            "qk_norms": sum("q_layernorm" in n for n, _ in trainer.model.named_parameters()),
            "expert_tp": mc.expert_tensor_parallel_size,
            "experts": sorted(
                {type(m).__name__ for n, m in trainer.model.named_modules() if n.endswith(".experts")}
            ),
        }
    return {
        "logp": ref.cpu(),
        "metrics": metrics,
        "grads": {k: v.cpu() for k, v in grads.items()},
        "optimizer_numel": [h for h, _, _ in per_rank],
        "state_restored": [r for _, r, _ in per_rank],
        "embeddings": [e for _, _, e in per_rank],
        "layout": layout,
        "weights": {k: v.cpu() for k, v in weights.items()},
        **mtp,
    }


def mtp_sent(trainer: Any) -> dict[str, dict[str, torch.Tensor]]:
    """The MTP layers' weights (``mtp.*``) as ``export_weights`` gathers them and as the refit streams
    them (every sender's on rank 0), fp32; how many ranks sent the input embedding (one: under PP the
    last stage's copy for the MTP layers stays home)."""
    from hpcrl.trainer.base import CollectSink
    from hpcrl.trainer.megatron.placement import gather_to_rank0

    loaded = {k: v.clone() for k, v in trainer.export_weights().items() if k.startswith("mtp.")}
    sink = CollectSink()
    trainer.stream_weights(sink, torch.float32)
    streamed: dict[str, torch.Tensor] = {}
    sent = {k: v for k, v in sink.weights.items() if k.startswith("mtp.")}
    parts = gather_to_rank0((sent, "backbone.embeddings.weight" in sink.weights))
    for part, _ in parts:
        streamed |= part
    return {"mtp_loaded": loaded, "mtp_streamed": streamed, "embedding_senders": sum(e for _, e in parts)}


def ran_layout(trainer: Any, world: int) -> dict[str, Any]:
    """What the ranks ran: Megatron's groups as built (not as asked), fsdp's data-parallel and
    context-parallel sizes (and the EP size of its experts' mesh)."""
    if not hasattr(trainer, "ps"):
        mesh = expert_layout(trainer).get("expert_mesh", {})
        moe = {"ep": mesh.get("ep", 1)} if mesh else {}
        return {"dp": trainer.data_rank()[1], "cp": trainer.cp.size, **moe}
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
        result = run_case(case, rank, world, master, out)
        dist.barrier()  # every rank stepped: only then does the case count as built
        faulthandler.cancel_dump_traceback_later()
        result["seconds"] = round(time.perf_counter() - started, 1)
        if rank == 0 and case.get("record", "build") == "build":
            (out / f"{case['id']}.json").write_text(json.dumps(result))
        elif rank == 0:
            torch.save(result, out / f"{case['id']}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
