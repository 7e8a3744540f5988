"""Attention in hpcrl's Megatron layer spec (the local spec's core-attention slot).

``SDPAttention``: torch's scaled_dot_product_attention (flash attention on GPUs) instead of Megatron's
unfused attention (which materialises [b, heads, s, s] scores: out of memory at 8 x 2048 on an H200);
causal, GQA without repeating K/V, sliding windows by Megatron's ``window_size`` fields (flex_attention
on GPUs, a boolean mask on CPUs), context parallel (keys and values gathered over the CP group:
``cp_gather``), and packed rows (``trainer.packing``): each sequence attends alone over the bounds in
``packed_seq_params`` (``varlen.attend_packed``: ``varlen_attn`` on GPUs in half precision where
``varlen.flash_takes`` the heads, SDPA per sequence elsewhere), on sliding-window layers too (each query's window inside its own sequence), no
[L, L] mask; under context parallel too, where a CP rank holds chunks of the row, not whole sequences
(``varlen.attend_packed_chunks``: each chunk's piece of each sequence against that sequence's gathered
keys). No mask is read anywhere. Family-free: every family's layers take it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from hpcrl.trainer.context_parallel import attend_chunks, chunk_order, sdpa, window_mask
from hpcrl.trainer.varlen import RowBounds, attend_packed, attend_packed_chunks


class SDPAttention(torch.nn.Module):
    """Megatron's core-attention slot filled with torch SDPA: causal, GQA without repeating K/V.

    Context parallel: Megatron gives each CP rank two of the 2·cp equal chunks of every sequence
    (rank r holds chunks r and 2·cp-1-r, so causal work is balanced). Keys and values are gathered
    from all CP ranks (the backward reduce-scatters their gradients back); each local query chunk
    attends to the keys of every chunk up to its own, causal within its own chunk — on a sliding-window
    layer only to the keys its window reaches, masked by global position (Gemma 3 under CP)."""

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        **_: Any,
    ) -> None:
        super().__init__()
        self.config = config
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.scale = softmax_scale
        self.window = sliding_window(config, layer_number)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("SDPAttention: attention bias needs Transformer Engine")
        if attention_mask is not None:  # never drop a mask silently: packed rows pass their bounds
            raise ValueError("SDPAttention reads no mask: a packed row passes its packed_seq_params")
        row = None if packed_seq_params is None else packed_seq_params.hpcrl_row
        # Megatron hands [s, b, heads, dim]; SDPA wants [b, heads, s, dim].
        s, b = query.shape[0], query.shape[1]
        if self.config.context_parallel_size > 1:
            out = self._context_parallel(query, key, value, row)
        elif row is not None:  # each packed sequence alone (its own windows), no mask
            return self._packed(query, key, value, row)
        else:
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            out = self._local(q, k, v)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _local(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Right-padded rows (the causal mask alone is exact for every real token), a sliding window on
        top."""
        s = q.shape[2]
        if self.window is None or s <= self.window:  # a window longer than the sequence is causal
            return self._sdpa(q, k, v, causal=True)
        if q.is_cuda and WINDOW_KERNEL == "flex":
            return flex_window_attention(q, k, v, self.window, self.scale)
        return self._sdpa(q, k, v, causal=window_mask(s, self.window, q.device))

    # Eager inside a compiled layer (as varlen's own): traced, the row's host lengths would be guarded
    # as constants and every new packed row would recompile the layer.
    @torch.compiler.disable
    def _packed(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, row: RowBounds
    ) -> torch.Tensor:
        """A packed row [s, 1, heads, dim] (``row``: its sequences) -> [s, 1, heads x dim]."""
        if self.training and self.dropout:
            raise ValueError("SDPAttention: packed rows run without attention dropout")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = attend_packed(q, k, v, self.scale, row, self.window)  # [1, s, heads, dim]
        return out.transpose(0, 1).flatten(2)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: Any) -> torch.Tensor:
        return sdpa(q, k, v, causal, dropout=self.dropout if self.training else 0.0, scale=self.scale)

    # Eager even inside a compiled layer: compiled, the gradient of the K/V all-gather (a reduce-scatter
    # in Megatron's autograd function) came out wrong on 2 H200s (grad norm 4.46 instead of 6.16).
    @torch.compiler.disable
    def _context_parallel(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, row: RowBounds | None
    ) -> torch.Tensor:
        """``row``: a packed row's sequences (row positions), each attended alone; None: causal."""
        from megatron.core import parallel_state as ps

        group = ps.get_context_parallel_group()
        # every rank's queries read these keys/values: their gradients are summed back to the owner
        k_all, v_all = (cp_gather(t, group, sum_grads=True).permute(1, 2, 0, 3) for t in (key, value))
        q = query.permute(1, 2, 0, 3)
        rank, cp = group.rank(), group.size()
        if row is not None:
            return attend_packed_chunks(q, k_all, v_all, rank, cp, self.window, row, self._sdpa)
        return attend_chunks(q, k_all, v_all, rank, cp, self.window, self._sdpa)


def sliding_window(config: Any, layer_number: int) -> int | None:
    """Keys a query of this (1-based, global) layer sees, itself included, under Megatron's
    ``window_size`` / ``window_attn_skip_freq``; None: every key before it."""
    from megatron.core.transformer.utils import is_layer_window_attention

    if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
        return int(config.window_size[0]) + 1
    return None


WINDOW_KERNEL = "flex"
"""Sliding-window layers on GPUs: ``flex`` (flex_attention, key blocks outside the window skipped) or
``sdpa`` (SDPA with a boolean mask: every key block computed). One H200, Gemma 3 1B's shape (8 x 2048,
4/1 heads of 256, window 512), forward + backward: flex 1.09 ms, masked SDPA 2.30 ms, causal flash
attention without a window 0.74 ms (bench/window_attention_bench.py). CPUs always take ``sdpa``."""


@functools.cache
def _window_block_mask(s: int, window: int, device: torch.device) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    def inside(b: Any, h: Any, q: Any, k: Any) -> Any:
        return (q >= k) & (q - k < window)

    return create_block_mask(inside, None, None, s, s, device=device)


@functools.cache
def _flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)  # eager flex_attention is a slow reference implementation


# Eager, like the CP path: the block mask is cached per (length, window) outside any compiled graph,
# and flex_attention runs as its own compiled kernel.
@torch.compiler.disable
def flex_window_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, scale: float | None, kernel: Any = None
) -> torch.Tensor:
    """Sliding-window causal attention on [b, heads, s, dim] (query i reads keys i - window + 1 .. i);
    ``kernel`` replaces the compiled flex_attention (tests pass the eager one)."""
    block = _window_block_mask(q.shape[2], window, q.device)
    run = kernel or _flex()
    return run(q, k, v, block_mask=block, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def cp_gather(t: torch.Tensor, group: Any, *, sum_grads: bool) -> torch.Tensor:
    """Every CP rank's part of dim 0 (its two chunks) -> the whole dim 0 in sequence order, on every
    rank. Backward: ``sum_grads`` sums the gradient over ranks (each rank used all of it), else each
    rank keeps its own part (each rank computed the same result from it)."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    cp = group.size()
    every = gather_from_sequence_parallel_region(t.contiguous(), sum_grads, group)
    order = torch.tensor(chunk_order(cp), device=t.device)
    return every.view(2 * cp, t.shape[0] // 2, *t.shape[1:]).index_select(0, order).flatten(0, 1)
