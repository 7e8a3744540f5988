"""Attention of a packed row without an [L, L] mask (``trainer.packing``): the kernels both backends
run (``attend_packed`` over a row's ``RowBounds``; megatron's ``SDPAttention`` calls it with the bounds
of ``packed_seq_params``) and the fsdp backend's hook into transformers.

transformers reads a packed row's sequence restarts from ``position_ids`` and builds, for SDPA, a
dense block-causal mask over the whole row: at 64 x 288 tokens that is an [18k, 18k] mask, and SDPA
with a mask leaves its flash kernel (session 23: 3.69 s packed against 0.37 s padded). Here the
packed forward runs under ``packed_attention(positions)``, which builds no mask (the mask function
answers None) and gives each layer's attention the sequences' bounds: on CUDA in half precision
torch's ``varlen_attn`` (flash attention over cumulative sequence lengths), elsewhere SDPA per
sequence (causal, no mask). Outside the block the registered function is transformers' own SDPA,
so the unpacked forwards of the same model are unchanged.

Sliding-window layers (Gemma 3's local layers) attend the same way, each query to the last ``window``
keys of its own sequence: ``varlen_attn``'s ``window_size`` where this torch's kernel takes one, else
SDPA per sequence, a long one in blocks of ``window`` queries under their own window masks (linear in
the sequence, never quadratic in the row).

Under context parallel (megatron, ``trainer.cp`` > 1) each CP rank holds two of the row's 2·cp chunks,
not whole sequences: ``attend_packed_chunks`` runs each chunk's part of each sequence against that
sequence's gathered keys up to it (causal lower-right, or its window), again no [L, L] tensor.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, cast

import torch

from hpcrl.trainer.context_parallel import Attend, window_mask

NAME = "hpcrl_packed"


@dataclass(frozen=True)
class RowBounds:
    """A packed row's sequences: ``cu`` int32 [N+1] on the row's device (0, then where each sequence
    ends) and the same ``lengths`` on the host (the per-sequence path splits by them, no device sync a
    layer). Positions past the last sequence are padding (megatron's rows at the budget's width)."""

    cu: torch.Tensor
    lengths: list[int]

    @property
    def longest(self) -> int:
        return max(self.lengths)

    @classmethod
    def of(cls, lengths: list[int], device: torch.device | str) -> RowBounds:
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
        return cls(cu, lengths)


_ROW: dict[str, RowBounds] = {}
"""The packed row's bounds (under ``"row"``) while a packed forward runs."""


def use_packed_attention(model: Any) -> bool:
    """Switch ``model``'s text attention from ``sdpa`` to this module's (idempotent); False where the
    model runs another implementation (eager, flex) or attends both ways (``use_bidirectional_attention``
    True, Gemma 3's, or ``"all"``): transformers' own mask stays for those. Gemma 4's ``"vision"`` (its larger
    checkpoints) is both ways among image tokens only: a text row is causal, and packed rows hold no images
    (``plan/packing.py`` refuses ``data.image_field``)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, packed_sdpa)
    AttentionMaskInterface.register(NAME, _mask)
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    both_ways = getattr(text, "use_bidirectional_attention", None) not in (None, False, "vision")
    if text._attn_implementation == "sdpa" and not both_ways:
        text._attn_implementation = NAME
    return text._attn_implementation == NAME


@contextmanager
def packed_attention(positions: torch.Tensor) -> Iterator[None]:
    """Within: attention of the registered implementation stays inside each sequence of the packed row
    whose ``positions`` [1, L] restart at 0 at each sequence."""
    starts = torch.nonzero(positions[0] == 0).flatten().tolist()
    bounds = [*starts, positions.shape[1]]
    _ROW["row"] = RowBounds.of([b - a for a, b in itertools.pairwise(bounds)], positions.device)
    try:
        yield
    finally:
        _ROW.clear()


def recompute_context() -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
    """``torch.utils.checkpoint``'s ``context_fn`` (``trainer.activation_checkpointing``): a layer run
    again in the backward attends inside the sequences its forward did. The row's bounds are known only
    inside ``packed_attention``, which has ended by the backward: without them the recompute took the
    unpacked path and saved other tensors (``CheckpointError``)."""
    return nullcontext(), _within(_ROW.get("row"))


@contextmanager
def _within(row: RowBounds | None) -> Iterator[None]:
    saved = dict(_ROW)
    _ROW.clear()
    if row is not None:
        _ROW["row"] = row
    try:
        yield
    finally:
        _ROW.clear()
        _ROW.update(saved)


def _mask(**kwargs: Any) -> torch.Tensor | None:
    """transformers' SDPA mask, none in a packed forward (the attention bounds each sequence itself)."""
    from transformers.masking_utils import sdpa_mask

    return None if _ROW else sdpa_mask(**kwargs)


# Eager inside a compiled layer: traced, the bounds (host lists in a global) would be guarded as constants
# and every new packed row would recompile the layer.
@torch.compiler.disable
def packed_sdpa(
    module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any
) -> tuple[torch.Tensor, None]:
    """The attention function: [1, H, L, D] in, [1, L, H, D] out (transformers' layout); a layer's
    ``sliding_window`` (keys a query reads, itself included, as transformers' mask counts them) bounds it."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not _ROW:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    window = kwargs.get("sliding_window")
    return attend_packed(query, key, value, kwargs.get("scaling"), _ROW["row"], window), None


def attend_packed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None,
    row: RowBounds,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention inside each sequence of a packed row: [1, H, L, D] queries, [1, H_kv, L, D]
    keys and values in, [1, L, H, D] out; ``window``: a sliding-window layer's keys a query reads,
    itself included (query i reads keys i - window + 1 .. i of its sequence). On CUDA torch's
    ``varlen_attn`` where ``flash_takes`` the heads (half precision, up to 256 wide), else SDPA per
    sequence; no [L, L] tensor either way. Padding past the last
    sequence attends nowhere: its output is 0 (no position reads it, and a finite value keeps every
    gradient finite)."""
    real = sum(row.lengths)
    if real < q.shape[2]:
        out = attend_packed(q[:, :, :real], k[:, :, :real], v[:, :, :real], scale, row, window)
        return torch.nn.functional.pad(out, (0, 0, 0, 0, 0, q.shape[2] - real))
    if window is not None and window >= row.longest:  # every sequence inside its window: causal
        window = None
    if q.is_cuda and flash_takes(q.dtype, q.shape[-1], scale, window):
        return _flash(q, k, v, scale, row, window)
    return _per_sequence(q, k, v, scale, row.lengths, window)


FLASH_HEAD_DIM = 256
"""The largest head FlashAttention's forward runs (Gemma 4's global layers have 512: SDPA per sequence)."""


def flash_takes(dtype: torch.dtype, head_dim: int, scale: float | None, window: int | None) -> bool:
    """Whether torch's ``varlen_attn`` (FlashAttention, on CUDA) runs this attention: half precision,
    heads up to 256, and what this torch's kernel can be asked: one without a scale keyword runs the
    default scale only, one without windows causal only."""
    sig = _varlen() if dtype in (torch.float16, torch.bfloat16) and head_dim <= FLASH_HEAD_DIM else None
    return (
        sig is not None
        and ("scale" in sig.parameters or scale is None or abs(scale * head_dim**0.5 - 1) < 1e-6)
        and (window is None or "window_size" in sig.parameters)
    )


def _per_sequence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Any, lengths: list[int], window: int | None
) -> torch.Tensor:
    """SDPA causal over each sequence alone: no [L, L] tensor, a kernel launch a sequence; a sequence
    longer than ``window`` in blocks of ``window`` queries (one within it is causal: the same keys)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # the grouped heads repeated per sequence, as transformers' repeat_kv orders them
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    parts = []
    for qs, ks, vs in zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2), strict=True):
        if window is None or qs.shape[2] <= window:
            parts.append(sdpa(qs, ks, vs, is_causal=True, scale=scale))
        else:
            parts.extend(_window_blocks(qs, ks, vs, scale, window))
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous()


def _window_blocks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Any, window: int
) -> list[torch.Tensor]:
    """One sequence's sliding-window attention, ``window`` queries at a time against the keys their
    windows reach (at most 2 x window - 1): [window, < 2 x window] masks, not one [s, s]: the scores
    outside every window are never computed."""
    n, out = q.shape[2], []
    for a in range(0, n, window):
        b, first = min(a + window, n), max(0, a - window + 1)
        reach = window_mask(b - a, window, q.device, first_query=a, first_key=first, keys=b - first)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        out.append(sdpa(q[:, :, a:b], k[:, :, first:b], v[:, :, first:b], attn_mask=reach, scale=scale))
    return out


def attend_packed_chunks(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    rank: int,
    cp: int,
    window: int | None,
    row: RowBounds,
    sdpa: Attend,
) -> torch.Tensor:
    """CP rank ``rank``'s attention over a packed row, [1, heads, 2c, d]: its queries (the row's chunks
    ``rank`` and ``2cp-1-rank``, c positions each) against the whole row's keys and values ([1,
    kv_heads, 2cp x c, d], in row order; ``row``: its sequences in row positions). Each query reads the
    keys of its own sequence up to itself (``window``: the last ``window`` of them): one ``sdpa`` call
    per piece of a sequence inside a chunk, causal lower-right against the sequence's keys up to the
    piece's end (flash on GPUs, no mask tensor), or, where the window cuts, under a [piece, < piece +
    window] mask. Nothing [L, L]. Padding past the last sequence attends nowhere: 0, as ``attend_packed``."""
    from torch.nn.attention.bias import causal_lower_right

    chunk, real = query.shape[2] // 2, sum(row.lengths)
    bounds = list(itertools.pairwise(itertools.accumulate(row.lengths, initial=0)))
    outs = []
    for j, g in enumerate((rank, 2 * cp - 1 - rank)):  # this rank's two chunks, by global index
        lo, hi = g * chunk, (g + 1) * chunk
        for start, end in bounds:
            a, b = max(lo, start), min(hi, end)  # the sequence's queries inside this chunk
            if a >= b:
                continue
            q = query[:, :, j * chunk + a - lo : j * chunk + b - lo]
            first = start if window is None else max(start, a - window + 1)
            causal: Any
            if window is not None and b - window > start:  # the window cuts some query's keys
                causal = window_mask(b - a, window, q.device, first_query=a, first_key=first, keys=b - first)
            else:
                causal = True if a == first else causal_lower_right(b - a, b - first)
            outs.append(sdpa(q, keys[:, :, first:b], values[:, :, first:b], causal))
        if hi > max(lo, real):  # the padding tail of the row in this chunk
            outs.append(query.new_zeros(*query.shape[:2], hi - max(lo, real), query.shape[3]))
    if real <= rank * chunk:  # both chunks past the row's last sequence: no piece read the keys
        outs[0] = outs[0] + _reads(keys, values)
    return torch.cat(outs, dim=2)


def _reads(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """0, computed from one element of the gathered keys and of the values. A CP rank whose chunks hold
    only padding reads neither, so its backward never reached their all-gather's backward, a
    reduce-scatter every CP rank must enter: the others waited in it for good (a packed row shorter
    than a chunk, megatron under CP). With this term the rank sends zeros there, as its share."""
    return (keys[0, 0, 0, 0] + values[0, 0, 0, 0]) * 0


_SIGNATURE: list[Any] = []


def _varlen() -> inspect.Signature | None:
    """``torch.nn.attention.varlen.varlen_attn``'s signature, None where this torch lacks it (its
    keywords changed between releases: ``is_causal`` in 2.9-2.10, ``window_size`` and ``enable_gqa`` later)."""
    if not _SIGNATURE:
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            _SIGNATURE.append(None)
        else:
            _SIGNATURE.append(inspect.signature(varlen_attn))
    return _SIGNATURE[0]


def _flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Any, row: RowBounds, window: int | None
) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    params = _varlen().parameters  # type: ignore[union-attr]
    groups = q.shape[1] // k.shape[1]
    # [1, H, L, D] -> [L, H, D], the packed layout the kernel takes
    q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))
    # torch 2.9-2.10: causal by a flag (and no window: attend_packed asks for none there)
    extra: dict[str, Any] = {"is_causal": True} if "is_causal" in params else {}
    if window is not None or not extra:  # keys left of the query (flash attention's count); -1: all
        extra["window_size"] = (-1 if window is None else window - 1, 0)
    if groups > 1 and "enable_gqa" in params:
        extra["enable_gqa"] = True
    elif groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if "scale" in params and scale is not None:
        extra["scale"] = scale
    cu, longest = row.cu, row.longest
    out = cast(torch.Tensor, varlen_attn(q, k, v, cu, cu, longest, longest, **extra))  # no aux asked
    return out[None]  # [1, L, H, D]
