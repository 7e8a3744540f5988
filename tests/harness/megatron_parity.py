"""One Megatron training step on the tiny model, run under torchrun (gloo, CPU): rank 0 saves the
logprobs, the step's metrics and the full (TP-gathered, stage-merged) gradients in HF names.

    python -m torch.distributed.run --nproc_per_node N tests/harness/megatron_parity.py MODEL_DIR OUT TP PP [BACKEND]

N = TP x PP x CP x DP (CP through HPCRL_PARITY_OVERRIDES="trainer.cp=2").

BACKEND is megatron (default) or fsdp (the reference: same batch, same loss, one process).
HPCRL_PARITY_OVERRIDES adds config overrides (space separated, e.g. "trainer.cp=2");
HPCRL_PARITY_DUMP_S prints every thread's stack and exits after that many seconds (to see a hang);
HPCRL_PARITY_ROUTES=1 gives the batch routes (``with_routes``) for ``trainer.router_replay``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from hpcrl.config.compose import compose_config
from hpcrl.trainer.batch import TrainBatch, build_batch


def parity_batch() -> TrainBatch:
    """Seven sequences of uneven length (micro-batches of 2 leave a short last one to pad). The pad id
    (0 in every test model) also occurs inside two sequences, where it is a real token: Hugging Face
    never sends the lookup's gradient to that row (``padding_idx``), and neither may Megatron."""
    gen = torch.Generator().manual_seed(0)
    prompts = [[1, *torch.randint(3, 120, (n,), generator=gen).tolist()] for n in (3, 5, 2, 4, 6, 3, 2)]
    comps = [torch.randint(3, 120, (n,), generator=gen).tolist() for n in (4, 2, 5, 3, 1, 4, 2)]
    prompts[1][2] = 0
    comps[5][1] = 0
    logps = [(-torch.rand(len(c), generator=gen) * 5).tolist() for c in comps]
    adv = [1.0, -1.0, 0.5, -0.5, 0.25, 2.0, -2.0]
    return build_batch(prompts, comps, logps, adv, [1.0] * 7, pad_id=0)


def with_routes(batch: TrainBatch, model_dir: Path) -> TrainBatch:
    """``batch`` with random routes for the model's MoE layers (``trainer.router_replay``): k distinct
    experts at every position but each row's last token and the padding (-1, the router's choice).
    Random, not the model's own choice, so a replayed step differs from a free one."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    layers, experts, k = cfg.num_hidden_layers, cfg.num_local_experts, cfg.num_experts_per_tok
    rows, width = batch.input_ids.shape
    gen = torch.Generator().manual_seed(1)
    routes = torch.rand(rows, width, layers, experts, generator=gen).argsort(-1)[..., :k].to(torch.int16)
    for i, n in enumerate(batch.attention_mask.sum(1).tolist()):
        routes[i, n - 1 :] = -1
    return dataclasses.replace(batch, routes=routes)


def after_checkpoint(batch: TrainBatch) -> TrainBatch:
    """The step after a checkpoint trains on the advantages turned round: with the first step's Adam
    state its update is ~5% of the learning rate, with a fresh state the whole rate (the same batch
    twice would give the same update either way)."""
    return dataclasses.replace(batch, advantages=-batch.advantages)


def overrides(tp: int, pp: int, backend: str = "megatron") -> list[str]:
    # fp32 everywhere: on GPUs too (HPCRL_PARITY_DEVICE=cuda), so ranks can be compared closely
    extra = os.environ.get("HPCRL_PARITY_OVERRIDES", "").split()
    return [
        "model=tiny",
        f"trainer={backend}",
        f"trainer.tp={tp}",
        f"trainer.pp={pp}",
        "trainer.precision=float32",
        "trainer.micro_batch_size=2",
        "algo.kl_coef=0.05",
        "algo.num_minibatches=1",
        *extra,
    ]


def stepped_grads(trainer: Any, backend: str) -> dict[str, torch.Tensor]:
    """Filled with the full gradients the step's last optimizer step used: the step frees them
    before it returns (``TrainStep``), so they are taken each time it drops them, the last time
    after that optimizer step. Every rank calls ``zero_grad`` together (megatron gathers over TP)."""
    seen: dict[str, torch.Tensor] = {}
    free = trainer.zero_grad

    def zero_grad() -> None:
        if backend == "megatron":
            grads = trainer.export_weights(grads=True)
        else:
            grads = {n: _full(p.grad) for n, p in trainer.model.named_parameters() if p.grad is not None}
        if grads:
            seen.clear()
            seen.update({k: v.detach().clone() for k, v in grads.items()})
        free()

    trainer.zero_grad = zero_grad  # until the caller deletes it (the class's own shows again)
    return seen


def watch_forwards(trainer: Any) -> dict[str, Any]:
    """What an fsdp step's forwards really ran, filled in as it runs: the token widths the model was
    called on (``widths``: 1/cp of the padded batch under context parallel) and how often the first
    decoder layer ran (``layer_calls``: twice per micro-batch under activation checkpointing).
    ``stop`` removes the hooks."""
    seen: dict[str, Any] = {"widths": set(), "layer_calls": 0}
    model = trainer.model

    def width(_module: Any, args: tuple) -> None:
        seen["widths"].add(int(args[0].shape[1]))

    def count(*_: Any) -> None:
        seen["layer_calls"] += 1

    hooks = [
        model.get_input_embeddings().register_forward_pre_hook(width),
        model.get_decoder().layers[0].register_forward_pre_hook(count),
    ]

    def stop() -> None:
        for h in hooks:
            h.remove()
        seen["widths"] = sorted(seen["widths"])

    seen["stop"] = stop
    return seen


def expert_layout(trainer: Any) -> dict[str, Any]:
    """fsdp's MoE experts as this rank holds them: the mesh of the first layer's first expert weight
    (named dimensions under expert parallelism), the experts whose rows it holds, and whether the
    layer's forward is the all-to-all dispatch."""
    from hpcrl.trainer.fsdp.expert_parallel import dispatch_forward, expert_modules

    experts = expert_modules(trainer.model)
    if not experts:
        return {}
    # the first weight of the first layer's experts (gated: gate_up_proj; Nemotron-H's: up_proj)
    weight = next(iter(experts[0].parameters()))
    mesh = weight.device_mesh
    return {
        "expert_mesh": dict(zip(mesh.mesh_dim_names or ("world",), mesh.shape, strict=True)),
        "expert_rows": weight.to_local().shape[0],
        "dispatch": getattr(experts[0].forward, "__func__", None) is dispatch_forward,
    }


@contextmanager
def counting_masks() -> Iterator[dict[str, int]]:
    """Within: how many packed rows' dense [L, L] block masks were built (``Packed.attention_mask``);
    megatron builds none (its attention reads the bounds, under context parallel too)."""
    from hpcrl.trainer.packing import Packed

    seen = {"masks": 0}
    build = Packed.attention_mask

    def counted(self: Packed) -> torch.Tensor:
        seen["masks"] += 1
        return build(self)

    Packed.attention_mask = counted  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        Packed.attention_mask = build  # type: ignore[method-assign]


def _full(grad: Any) -> torch.Tensor:
    """An FSDP2 gradient (a DTensor) as one plain tensor."""
    return (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()


def _state_round_trip(trainer: Any, local: Any, out: Path) -> bool:
    """Checkpoint as the loop does (every rank writes its pieces into ``<out>.ckpt``), wipe this
    rank's optimizer state, load it back: True when each rank got its own state back."""
    path = str(out.with_suffix(".ckpt"))
    trainer.save_checkpoint(path, async_save=True)
    trainer.finish_checkpoint()
    before = [v.clone() for st in local.state.values() for v in st.values() if torch.is_tensor(v)]
    for st in local.state.values():
        for v in st.values():
            if torch.is_tensor(v):
                v.zero_()
    trainer.load_checkpoint(path)
    after = [v for st in local.state.values() for v in st.values() if torch.is_tensor(v)]
    return len(before) == len(after) > 0 and all(
        torch.equal(a, b) for a, b in zip(before, after, strict=True)
    )


def main() -> None:
    model_dir, out, tp, pp = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    from hpcrl.trainer import make_trainer

    backend = sys.argv[5] if len(sys.argv) > 5 else "megatron"
    if os.environ.get("HPCRL_PARITY_DUMP_S"):
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["HPCRL_PARITY_DUMP_S"]), exit=True)
    torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    master = f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ.get('MASTER_PORT', 29500)}"
    cfg = compose_config(overrides(tp, pp, backend))
    device = os.environ.get("HPCRL_PARITY_DEVICE", "cpu")
    trainer: Any = make_trainer(model_dir, cfg, rank, world, master, device)
    batch = parity_batch()
    if os.environ.get("HPCRL_PARITY_ROUTES"):
        batch = with_routes(batch, model_dir)
    resume = os.environ.get("HPCRL_PARITY_RESUME")  # a checkpoint of another layout: load, then step
    if resume:
        trainer.load_checkpoint(resume)
        batch = after_checkpoint(batch)
    loaded = {k: v.clone() for k, v in trainer.export_weights().items()} if resume else {}  # TP=1: views
    with counting_masks() as masks:
        ref = trainer.logprobs(
            batch, reference=True
        )  # the loaded weights' log-probs (the step scores its own)
        grads = stepped_grads(trainer, backend)
        forwards = watch_forwards(trainer) if backend == "fsdp" else {}
        metrics = trainer.train_step(batch)
    forwards.pop("stop", lambda: None)()
    del trainer.zero_grad  # this step's gradients only (a second step may follow the checkpoint)
    assert grads or rank != 0, "no gradients were seen before the step freed them"
    weights = trainer.export_weights()
    # optimizer state elements held by each rank (sharded under the distributed optimizer)
    local = trainer.local_optimizer() if backend == "megatron" else trainer.optimizer
    held = sum(
        v.numel() for st in local.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()
    )
    restored = _state_round_trip(trainer, local, out)
    after = {}
    if os.environ.get("HPCRL_PARITY_SECOND_STEP"):  # the step after the checkpoint, for a resume to repeat
        trainer.train_step(after_checkpoint(batch))
        after = trainer.export_weights()
    per_rank: list[Any] = [None] * world
    if world > 1:
        torch.distributed.all_gather_object(per_rank, (held, restored))
    else:
        per_rank = [(held, restored)]
    # what the model really ran with (Megatron may not do what the config asks without saying so)
    layout: dict[str, Any] = {}
    if backend == "fsdp":
        layout = {"cp": trainer.cp.size, "dp": trainer.data_rank()[1], **forwards, **expert_layout(trainer)}
    if backend == "megatron":
        mc = trainer.model.config
        layout = {
            "sequence_parallel": mc.sequence_parallel,
            "cp": mc.context_parallel_size,
            "packed_masks": masks["masks"],
            "pack_width": trainer.pipeline.pack_width,  # None: micro-batches of padded rows
            "qk_norms": sum("q_layernorm" in n for n, _ in trainer.model.named_parameters()),
            "expert_tp": mc.expert_tensor_parallel_size,
            "experts": sorted(
                {type(m).__name__ for n, m in trainer.model.named_modules() if n.endswith(".experts")}
            ),
            "expert_fc1_rows": [
                tuple(p.shape)
                for n, p in trainer.model.named_parameters()
                if "local_experts.0.linear_fc1" in n
            ][:1],
        }
    if rank == 0:
        cpu = {k: v.cpu() for k, v in grads.items()}
        torch.save(
            {
                "logp": ref.cpu(),
                "metrics": metrics,
                "grads": cpu,
                "optimizer_numel": [h for h, _ in per_rank],
                "state_restored": [r for _, r in per_rank],
                "layout": layout,
                "weights": {k: v.cpu() for k, v in weights.items()},
                "loaded": {k: v.cpu() for k, v in loaded.items()},
                "second_step": {k: v.cpu() for k, v in after.items()},
            },
            out,
        )
    # Leave together and close the groups: a rank exiting while gloo's threads still run can abort
    # ("terminate called without an active exception"; seen once at TP=2 x CP=2 on a 2-core machine).
    if torch.distributed.is_initialized():
        if world > 1:
            torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
