"""Context parallelism for the fsdp backend: each sequence split over ``trainer.cp`` ranks.

The CP ranks of one data-parallel shard get the same rows. Each runs the model on 1/cp of every
sequence's positions, so activations (and the logits) shrink by cp. Attention is the one place where
positions meet: each layer all-gathers the keys and values of its CP group (the all-gather variant
that Llama 3's training used; GQA keeps K/V a fraction of the activations) and attends its own
queries to them under a mask built from positions. Everything else (MLPs, MoE, norms, the
log-prob head) is per token.

Load balance under the causal mask: the padded sequence is cut into 2 x cp chunks and rank r takes
chunks r and 2cp-1-r, so every rank holds as many early (cheap) as late (costly) queries (Megatron's
split). Rotary embeddings see the true positions (``position_ids``).

The per-token log-probs are all-gathered back to whole rows, so the loss (token-level or
sequence-level, GSPO included) is computed whole on every CP rank. The all-gathers' backward sums
the CP ranks' gradients into each owner's slice: the parameter gradient becomes cp x the row's, and
FSDP's mean over the dp x cp ranks turns that into the data-parallel mean. No loss rescaling.

Models whose layers carry state across positions (Mamba) cannot be split this way: the backend
refuses them under cp > 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

ATTENTION = "hpcrl_cp"
"""The name this module's attention function is registered under (transformers' AttentionInterface)."""


@dataclass
class CPLayout:
    """Which positions of a width-``width`` batch this rank holds (``local``, in its order) and the
    order the group's all-gather puts every rank's positions in (``gathered``)."""

    cp: int
    rank: int
    group: Any
    width: int
    """The padded width: a multiple of 2 x cp."""
    local: torch.Tensor
    gathered: torch.Tensor
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def of(cls, width: int, cp: int, rank: int, group: Any, device: torch.device | str) -> CPLayout:
        padded = -(-width // (2 * cp)) * 2 * cp
        chunk = padded // (2 * cp)
        parts = [rank_positions(r, cp, chunk) for r in range(cp)]
        return cls(cp, rank, group, padded, parts[rank].to(device), torch.cat(parts).to(device))

    def shard(self, t: torch.Tensor, pad: int | float = 0) -> torch.Tensor:
        """This rank's positions of ``t`` [b, T, ...] (padded to ``width`` with ``pad`` first)."""
        grown = torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, self.width - t.shape[1]), value=pad)
        return grown[:, self.local]

    def unshard(self, local: torch.Tensor, width: int) -> torch.Tensor:
        """[b, width] whole rows from every rank's [b, T/cp] part (differentiable: the backward sums
        the group's gradients into each rank's slice)."""
        everything = GatherSeq.apply(local, 1, self.group)
        return everything[:, torch.argsort(self.gathered)][:, :width]

    def mask(self, window: int | None) -> torch.Tensor:
        """[local, gathered] True where a query may see a key: causal, within ``window`` if given."""
        if window not in self._masks:
            q, k = self.local[:, None], self.gathered[None, :]
            seen = k <= q
            self._masks[window] = seen if window is None else seen & (q - k < window)
        return self._masks[window]


def rank_positions(rank: int, cp: int, chunk: int) -> torch.Tensor:
    """Chunks ``rank`` and ``2cp-1-rank`` of a sequence cut into 2 x cp chunks of ``chunk``."""
    late = 2 * cp - 1 - rank
    return torch.cat(
        [torch.arange(rank * chunk, (rank + 1) * chunk), torch.arange(late * chunk, (late + 1) * chunk)]
    )


class GatherSeq(torch.autograd.Function):
    """All-gather along ``dim`` over ``group`` (rank order); backward: the sum of every rank's gradient
    for this rank's slice (a reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        n, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        parts = [p.contiguous() for p in grad.chunk(n, dim=ctx.dim)]
        if dist.get_backend(ctx.group) == "nccl":
            mine = torch.empty_like(parts[rank])
            dist.reduce_scatter(mine, parts, group=ctx.group)
            return mine, None, None
        summed = grad.contiguous()  # gloo has no reduce-scatter: sum everything, keep this rank's slice
        dist.all_reduce(summed, group=ctx.group)
        return summed.chunk(n, dim=ctx.dim)[rank].contiguous(), None, None


def cp_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    hpcrl_cp: CPLayout | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention call ([b, heads, s, d] each) with the group's keys and values.
    ``hpcrl_cp``: the layout, passed to the model call as a keyword that transformers hands down to
    every attention call (and that activation checkpointing keeps for the recompute)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if hpcrl_cp is None:
        raise RuntimeError("trainer.cp > 1: call the model with hpcrl_cp=<its CPLayout>")
    layout = hpcrl_cp
    keys, values = GatherSeq.apply(key, 2, layout.group), GatherSeq.apply(value, 2, layout.group)
    mask = layout.mask(sliding_window)[None, None]
    kwargs.pop("is_causal", None)
    return sdpa_attention_forward(
        module, query, keys, values, mask, dropout=dropout, scaling=scaling, is_causal=False, **kwargs
    )


def use_cp_attention(model: Any) -> None:
    """Register the attention function and switch ``model``'s text attention to it. transformers
    builds no mask for an implementation it has no mask function for: the function makes its own."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, cp_attention)
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for c in {id(config): config, id(text): text}.values():
        c._attn_implementation = ATTENTION


@dataclass(frozen=True)
class CPGroup:
    """This rank's context-parallel group: ``size`` consecutive ranks (on one node, where the
    per-layer all-gathers have NVLink), this rank ``rank`` among them."""

    size: int
    rank: int
    group: Any

    @classmethod
    def make(cls, world: int, cp: int) -> CPGroup:
        """Every rank creates every group, as torch asks."""
        if world % cp:
            raise ValueError(f"trainer.cp={cp} does not divide the {world} training ranks")
        groups = [dist.new_group(list(range(d * cp, (d + 1) * cp))) for d in range(world // cp)]
        rank = dist.get_rank()
        return cls(cp, rank % cp, groups[rank // cp])

    def layout(self, width: int, device: torch.device | str) -> CPLayout:
        return CPLayout.of(width, self.size, self.rank, self.group, device)
