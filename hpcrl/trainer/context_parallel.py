"""Context parallelism for the fsdp backend: each sequence split over ``trainer.cp`` ranks.

The CP ranks of one data-parallel shard get the same rows. Each runs the model on 1/cp of every
sequence's positions, so activations (and the logits) shrink by cp. Attention is the one place where
positions meet: each layer all-gathers the keys and values of its CP group (the all-gather variant
that Llama 3's training used; GQA keeps K/V a fraction of the activations) and each of its two query
chunks attends to the keys up to its own (``attend_chunks``, which megatron's CP attention shares):
causal within its own chunk (lower-right: flash on GPUs up to head dim 256), a sliding window masked
by true position (``sdpa``). Everything else (MLPs, MoE, norms, the log-prob head) is per token.

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

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hpcrl.trainer.process_group import own_group

ATTENTION = "hpcrl_cp"
"""The name this module's attention function is registered under (transformers' AttentionInterface)."""


@dataclass
class CPLayout:
    """Which positions of a width-``width`` batch this rank of ``group`` holds (``local``, in its order)
    and the order the group's all-gather puts every rank's positions in (``gathered``)."""

    group: CPGroup
    width: int
    """The padded width: a multiple of 2 x cp."""
    local: torch.Tensor
    gathered: torch.Tensor

    @functools.cached_property
    def in_order(self) -> torch.Tensor:
        """Indices that put an all-gathered dim back in sequence order."""
        return torch.argsort(self.gathered)

    @classmethod
    def of(cls, width: int, group: CPGroup, device: torch.device | str) -> CPLayout:
        cp = group.size
        padded = -(-width // (2 * cp)) * 2 * cp
        parts = [rank_positions(r, cp, padded // (2 * cp)) for r in range(cp)]
        return cls(group, padded, parts[group.rank].to(device), torch.cat(parts).to(device))

    def shard(self, t: torch.Tensor, pad: int | float = 0) -> torch.Tensor:
        """This rank's positions of ``t`` [b, T, ...] (padded to ``width`` with ``pad`` first)."""
        grown = torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, self.width - t.shape[1]), value=pad)
        return grown[:, self.local]

    def unshard(self, local: torch.Tensor, width: int) -> torch.Tensor:
        """[b, width] whole rows from every rank's [b, T/cp] part (differentiable: the backward sums
        the group's gradients into each rank's slice)."""
        return self.gather(local, 1)[:, :width]

    def gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's part of ``dim`` -> the whole of it in sequence order (differentiable)."""
        return GatherSeq.apply(t, dim, self.group.group).index_select(dim, self.in_order)


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
        # gloo has no reduce-scatter: sum everything (in a copy: autograd's gradient is not ours to
        # overwrite), keep this rank's slice
        summed = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(summed, group=ctx.group)
        return summed.chunk(n, dim=ctx.dim)[rank].contiguous(), None, None


# Eager even inside a compiled layer (as megatron's CP attention): compiled, the gradient of the K/V
# all-gather came out wrong on 2 H200s there.
@torch.compiler.disable
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
    """transformers' attention call ([b, heads, s, d] each) with the group's keys and values;
    returns [b, s, heads, d] as transformers' own. ``hpcrl_cp``: the layout, passed to the model call
    as a keyword that transformers hands down to every attention call (and that activation
    checkpointing keeps for the recompute)."""
    if hpcrl_cp is None:
        raise RuntimeError("trainer.cp > 1: call the model with hpcrl_cp=<its CPLayout>")
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise ValueError(
            "trainer=fsdp context parallel: attention logit soft-capping and sinks are not supported"
        )
    keys, values = hpcrl_cp.gather(key, 2), hpcrl_cp.gather(value, 2)
    attend = functools.partial(sdpa, dropout=dropout if module.training else 0.0, scale=scaling)
    group = hpcrl_cp.group
    out = attend_chunks(query, keys, values, group.rank, group.size, sliding_window, attend)
    return out.transpose(1, 2).contiguous(), None


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any], torch.Tensor]
"""(q, k, v, causal) -> attention output; causal: True (top-left), a CausalBias or a boolean mask."""


def attend_chunks(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    rank: int,
    cp: int,
    window: int | None,
    sdpa: Attend,
) -> torch.Tensor:
    """CP rank ``rank``'s attention, [b, heads, 2c, d]: its queries (chunks ``rank`` and
    ``2cp-1-rank``, c positions each) against the whole sequence's keys and values ([b, kv_heads, 2cp x
    c, d], in sequence order). Each chunk reads the keys up to its own end, causal within its own
    chunk; a sliding-window layer (a query sees keys q - window < k <= q) only the keys its window
    reaches, masked by true position. A packed row's sequences: ``varlen.attend_packed_chunks``."""
    from torch.nn.attention.bias import causal_lower_right

    chunk = query.shape[2] // 2
    outs = []
    for j, g in enumerate((rank, 2 * cp - 1 - rank)):  # this rank's two chunks, by global index
        q = query[:, :, j * chunk : (j + 1) * chunk]
        seen = (g + 1) * chunk
        reach = None if window is None or seen <= window else window  # every key in reach: causal
        first = 0 if reach is None else max(0, g * chunk - reach + 1)
        k, v = keys[:, :, first:seen], values[:, :, first:seen]
        causal: Any
        if reach is not None:
            causal = window_mask(
                chunk, reach, q.device, first_query=g * chunk, first_key=first, keys=seen - first
            )
        else:
            causal = True if g == 0 else causal_lower_right(chunk, seen)
        outs.append(sdpa(q, k, v, causal))
    return torch.cat(outs, dim=2)


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: Any,
    *,
    dropout: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """torch SDPA on [b, heads, s, d] with fewer K/V heads than query heads (GQA). ``causal``: True
    (top-left causal: flash), a ``CausalBias`` (lower-right: flash, GQA included) or a boolean mask.
    With a mask, K/V heads are repeated first: SDPA runs GQA on the flash and math kernels only, and
    flash takes no mask, so a mask with ``enable_gqa`` would fall to the math kernel and its fp32
    [b, heads, s, keys] scores; repeated, the memory-efficient kernel takes it (transformers does
    the same)."""
    gqa = q.shape[1] != k.shape[1]
    if isinstance(causal, torch.Tensor) and gqa:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        gqa = False
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=None if causal is True else causal,
        is_causal=causal is True,
        dropout_p=dropout,
        scale=scale,
        enable_gqa=gqa,
    )


def window_mask(
    s: int,
    window: int,
    device: torch.device,
    first_query: int = 0,
    first_key: int = 0,
    keys: int | None = None,
) -> torch.Tensor:
    """[s, keys (default s)], True where the query at position ``first_query + i`` may read the key at
    ``first_key + j``: key <= query and query - key < window (sliding-window causal)."""
    q = torch.arange(first_query, first_query + s, device=device)
    k = torch.arange(first_key, first_key + (s if keys is None else keys), device=device)
    distance = q[:, None] - k[None, :]
    return (distance >= 0) & (distance < window)


def chunk_order(cp: int) -> list[int]:
    """Where global chunk g sits in the CP all-gather (rank r contributes chunks r, 2·cp-1-r)."""
    return [2 * g if g < cp else 2 * (2 * cp - 1 - g) + 1 for g in range(2 * cp)]


def use_cp_attention(model: Any) -> None:
    """Register the attention function and switch ``model``'s text attention to it. transformers
    builds no mask for an implementation it has no mask function for: the function makes its own."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, cp_attention)
    config = model.config
    # the text config only: set on a vision-language model's own config, transformers would switch its
    # vision and audio towers too (never run in text RL, but they would then need a layout)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    text._attn_implementation = ATTENTION


@dataclass(frozen=True)
class CPGroup:
    """This rank's context-parallel group: ``size`` consecutive ranks (on one node when cp is at
    most the GPUs per node, so the per-layer all-gathers stay on NVLink), this rank ``rank`` among them."""

    size: int
    rank: int
    group: Any

    @classmethod
    def make(cls, world: int, cp: int) -> CPGroup:
        """Every rank creates every group, as torch asks."""
        if world % cp:
            raise ValueError(f"trainer.cp={cp} does not divide the {world} training ranks")
        group = own_group([range(d * cp, (d + 1) * cp) for d in range(world // cp)])
        return cls(cp, dist.get_rank() % cp, group)

    def layout(self, width: int, device: torch.device | str) -> CPLayout:
        return CPLayout.of(width, self, device)
