"""Expert parallelism under FSDP2 (``trainer.ep``): each MoE layer's experts split over ``ep`` ranks,
the tokens sent to the ranks that hold their routed experts by all-to-all and their outputs sent back.

The training ranks form a (expert data parallel, ep) mesh, EP groups of consecutive ranks. An EP rank
holds ``num_experts / ep`` experts of every layer (a DTensor sharded on dim 0 over the EP dimension),
which ``fully_shard`` splits further over the expert-data-parallel ranks (torchtitan's
``dp_shard_mod_ep``); the router and every dense weight stay sharded over all ranks. The experts'
global shape and names are unchanged, so checkpoints (DCP), weight streaming (``full_tensor``) and
loading (``hf_load.local_rows``) see the same tensors as without EP.

Gradients: an expert's gradient on its EP rank already sums the tokens of the whole EP group (the
all-to-all's backward brings them home); FSDP sums it over expert data parallel and divides by the
world size, the mean every dense gradient gets.

transformers keeps Qwen3-MoE's and Gemma 4's experts alike (``Qwen3MoeExperts``,
``Gemma4TextExperts``: ``gate_up_proj`` [E, 2I, H] as [gate; up], ``down_proj`` [E, H, I], called
with the tokens, their top-k expert ids and weights): that form is what ``dispatch_forward`` runs.
"""

from __future__ import annotations

from types import MethodType
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def expert_modules(model: Any) -> list[torch.nn.Module]:
    """The grouped-experts module of every MoE decoder layer (transformers' ``*Experts`` classes,
    which ``use_experts_implementation`` marks with ``_is_expert_parallel``)."""
    return [m for m in model.get_decoder().modules() if hasattr(m, "_is_expert_parallel")]


def unsupported(experts: torch.nn.Module) -> str:
    """Why ``dispatch_forward`` cannot run these experts ("" where it can)."""
    form = (
        getattr(experts, "has_gate", False),
        getattr(experts, "is_concatenated", False),
        not getattr(experts, "is_transposed", True),
        not getattr(experts, "has_bias", True),
    )
    if not all(form) or not all(hasattr(experts, w) for w in EXPERT_WEIGHTS):
        return f"{type(experts).__name__} (not gated [gate; up] experts without bias)"
    return ""


def check_model(model: Any, ep: int) -> list[torch.nn.Module]:
    """The experts to split ``ep`` ways, or one line saying why this model cannot be."""
    experts = expert_modules(model)
    if not experts:
        raise ValueError(f"trainer.ep={ep}: {type(model).__name__} has no grouped experts; set trainer.ep=1")
    if gaps := sorted({g for e in experts if (g := unsupported(e))}):
        raise ValueError(
            f"trainer=fsdp splits only gated experts over trainer.ep, not {gaps[0]}; set trainer.ep=1"
        )
    total = getattr(experts[0], "num_experts", 0)
    if total % ep:
        raise ValueError(f"trainer.ep={ep} must divide the model's {total} experts")
    return experts


def expert_mesh(device_type: str, world: int, ep: int) -> Any:
    """The (edp, ep) mesh: EP groups of ``ep`` consecutive ranks (inside a node where ep <= GPUs per
    node, where the all-to-all is fastest), expert data parallel across them."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (world // ep, ep), mesh_dim_names=("edp", "ep"))


def split_experts(experts: torch.nn.Module, mesh: Any) -> None:
    """Keep this EP rank's experts (on the meta device, before ``fully_shard``) as DTensors of the
    whole layer's shape, and route the module's forward through the all-to-all."""
    from torch.distributed.tensor import DTensor, Shard

    ep_mesh = mesh["ep"]
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for name in EXPERT_WEIGHTS:
        whole = getattr(experts, name)
        n = whole.shape[0] // ep
        local = whole.detach()[rank * n : (rank + 1) * n]
        shard = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
        setattr(experts, name, torch.nn.Parameter(shard, requires_grad=whole.requires_grad))
    experts.ep_group = ep_mesh.get_group()
    experts.forward = MethodType(dispatch_forward, experts)


def shard_experts(experts: torch.nn.Module, mesh: Any, shard: dict[str, Any], world: int) -> None:
    """``fully_shard`` the EP rank's experts over expert data parallel, averaged as dense weights are
    (over all ``world`` ranks: see the module docstring). With one expert-DP rank FSDP divides by the
    factor itself; over several it sums, then divides (gloo has no pre-multiplied sum)."""
    from torch.distributed.fsdp import fully_shard

    unit: Any = fully_shard(experts, **{**shard, "mesh": mesh["edp"]})
    unit.set_gradient_divide_factor(float(world))
    if mesh["edp"].size() > 1:
        unit.set_force_sum_reduction_for_comms(True)


def _local(weight: torch.Tensor) -> torch.Tensor:
    return weight.to_local() if hasattr(weight, "to_local") else weight


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    """All-to-all of rows with autograd (the backward sends the gradients the opposite way)."""
    from torch.distributed.nn.functional import all_to_all_single

    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    return all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)


def _inverse(order: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return inv


@torch.compiler.disable  # data-dependent split sizes (host syncs): the layer compiles around it
def dispatch_forward(
    self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The grouped experts' forward under EP: (token, expert) pairs sorted by expert go to the EP rank
    that holds it, run there, come back, and are weighted and summed per token here (so the router's
    weights never cross the wire)."""
    group = self.ep_group
    ep, tokens, k = dist.get_world_size(group), *top_k_index.shape
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=self.num_experts)
    got = torch.empty_like(counts)  # [source rank, my expert]: how many pairs each rank sends each
    dist.all_to_all_single(got, counts, group=group)
    sent = counts.view(ep, -1).sum(1).tolist()
    received = got.view(ep, -1).sum(1).tolist()
    x = _exchange(hidden_states[order // k], received, sent, group)
    y = _run_local(self, x, got.view(ep, -1))
    back = _exchange(y, sent, received, group)[_inverse(order)]
    out = (back.view(tokens, k, -1) * top_k_weights.unsqueeze(-1).to(back.dtype)).sum(1)
    return out.to(hidden_states.dtype)


def _run_local(self: Any, x: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """This rank's experts on the rows received (each source's rows sorted by expert). Every local
    expert runs, on no rows at worst, so each has a gradient for FSDP to reduce on every rank."""
    gate_up, down = _local(self.gate_up_proj), _local(self.down_proj)
    n = got.shape[1]
    ids = torch.repeat_interleave(torch.arange(n, device=x.device).repeat(got.shape[0]), got.reshape(-1))
    by_expert = torch.argsort(ids, stable=True)
    outs = []
    for e, rows in enumerate(x[by_expert].split(got.sum(0).tolist())):
        gate, up = F.linear(rows, gate_up[e]).chunk(2, dim=-1)
        outs.append(F.linear(self.act_fn(gate) * up, down[e]))
    return torch.cat(outs)[_inverse(by_expert)]
