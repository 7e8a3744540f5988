"""Packed rows under context parallel (megatron, ``trainer.cp`` > 1): each CP rank's two chunks of the
row attend per sequence against the gathered keys (``varlen.attend_packed_chunks``), no [L, L] mask.
One process plays every CP rank (as tests/trainer/test_fsdp_cp.py): a rank's queries are its chunks of
the row (``rank_positions``), its keys and values the whole row in order (what ``cp_gather`` gives)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.nn.attention.bias import CausalBias

from hpcrl.trainer.context_parallel import attend_chunks, rank_positions, sdpa, window_mask
from hpcrl.trainer.packing import Packed
from hpcrl.trainer.varlen import RowBounds, attend_packed_chunks

LENGTHS, HEADS, KV, DIM = [5, 1, 12, 7], 6, 2, 8
"""Sequences that start and end mid-chunk, span three chunks, fill one exactly (cp=3) and a single
token; 3 query heads a KV head. The row is padded to a multiple of 2·cp: 28 at cp=2 (3 positions of
padding in the last chunk), 30 at cp=3 (a whole chunk of padding)."""
REAL = sum(LENGTHS)


def reference(q, k, v, width: int, window: int | None) -> torch.Tensor:
    """SDPA over the whole row under the packed row's dense block-causal mask (``Packed.attention_mask``,
    the padding one more sequence) and the window by true position, [1, H, width, D]."""
    rows = torch.zeros(len(LENGTHS), max(LENGTHS), dtype=torch.long)
    real = torch.arange(max(LENGTHS))[None] < torch.tensor(LENGTHS)[:, None]
    allowed = ~Packed.of(rows, real.long()).padded(width).attention_mask()[0, 0]
    if window is not None:
        allowed = allowed & window_mask(width, window, q.device)
    return sdpa(q, k, v, allowed, scale=0.3)


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("window", [None, 4, 100])
def test_each_ranks_chunks_attend_per_sequence_as_the_masked_row(cp, window):
    """Every rank's outputs at the real tokens and the input gradients of a loss on them (summed over the
    ranks, as the K/V gather's backward sums them) equal the masked reference's; the padding's outputs
    are 0. No call reads a mask without a window, or with one that reaches every key (100); with a window
    of 4 the masks span a chunk's queries and at most window - 1 keys more, never the row. The mutation:
    the same chunks attended causally over the whole row (``attend_chunks``, no bounds) differ."""
    chunk = -(-REAL // (2 * cp))
    width = 2 * cp * chunk
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, width, DIM, generator=gen).requires_grad_() for h in (HEADS, KV, KV))
    row = RowBounds.of(LENGTHS, "cpu")
    masks: list[torch.Tensor] = []

    def recording(q_, k_, v_, causal):
        if isinstance(causal, torch.Tensor) and not isinstance(causal, CausalBias):  # a boolean mask
            masks.append(causal)
        return sdpa(q_, k_, v_, causal, scale=0.3)

    out = torch.zeros(1, HEADS, width, DIM)
    unbounded = torch.zeros(1, HEADS, width, DIM)
    for rank in range(cp):
        mine = rank_positions(rank, cp, chunk)
        out = out.index_copy(
            2, mine, attend_packed_chunks(q[:, :, mine], k, v, rank, cp, window, row, recording)
        )
        causal = attend_chunks(q[:, :, mine], k, v, rank, cp, window, functools.partial(sdpa, scale=0.3))
        unbounded[:, :, mine] = causal.detach()
    want = reference(q, k, v, width, window)
    assert torch.allclose(out[:, :, :REAL], want[:, :, :REAL], atol=1e-5)
    assert not out[:, :, REAL:].any()
    got = torch.autograd.grad(out[:, :, :REAL].square().sum(), (q, k, v))
    expected = torch.autograd.grad(want[:, :, :REAL].square().sum(), (q, k, v))
    assert all(torch.allclose(g, w, atol=1e-5) for g, w in zip(got, expected, strict=True))
    if window in (None, 100):
        assert masks == []
    else:
        assert masks
        assert max(m.shape[0] for m in masks) <= chunk
        assert max(m.shape[1] for m in masks) <= chunk + window - 1
    assert (unbounded[:, :, :REAL] - want[:, :, :REAL].detach()).abs().max() > 0.1


def test_a_rank_holding_only_padding_still_sends_its_keys_a_gradient():
    """A row shorter than a chunk (the last bin of a step, a filler micro-batch): at cp=2 rank 1's
    chunks (1 and 2 of 4) hold only padding. Its output is 0, and yet the gradient reaches the gathered
    keys and values (zeros): their all-gather's backward is a reduce-scatter every CP rank must enter
    (megatron's ``cp_gather``), and a rank whose graph skipped it left the others waiting there for good
    (the packed step's hang under CP). Rank 0, which reads them, gets its gradient as before."""
    lengths, cp, chunk = [3, 2], 2, 6
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 4 * chunk, DIM, generator=gen).requires_grad_() for h in (HEADS, KV, KV))
    row = RowBounds.of(lengths, "cpu")
    attend = functools.partial(sdpa, scale=0.3)
    outs = {
        r: attend_packed_chunks(q[:, :, rank_positions(r, cp, chunk)], k, v, r, cp, None, row, attend)
        for r in range(cp)
    }
    assert not outs[1].any()
    assert outs[1].requires_grad  # without the keys: no graph at all
    grads = torch.autograd.grad(outs[1].sum(), (k, v), allow_unused=True)
    assert all(g is not None for g in grads)
    assert not any(g.any() for g in grads if g is not None)
    assert torch.autograd.grad(outs[0].square().sum(), k)[0].abs().sum() > 0
