"""The Mamba-2 mixer's sequence mixing in torch: the SSD chunked scan (Mamba-2 paper, Listing 1) and
the depthwise causal conv, both able to run a packed row (``trainer.packing``) as its sequences.

A packed row holds several sequences one after another; ``seq_idx`` [b, L] numbers each token's
sequence, as mamba_ssm's and causal_conv1d's kernels take it. With it the conv never reads a token of
another sequence (each sequence sees zeros before its start, as it would alone) and the scan starts
each sequence from a zero state: the decay between two tokens of different sequences is masked to an
exact 0 (the log-decay set to -inf, never a difference of two -infs), inside a chunk, from a chunk's
tokens to its end state, from one chunk's end state to the next, and from a chunk's start state to
its tokens. Both backends' torch paths run these: the megatron mixer (``megatron/ssm.py``) and
transformers' Nemotron-H mixer under packing (``fsdp/segments.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def seq_index(positions: torch.Tensor) -> torch.Tensor:
    """[b, L] positions restarting at 0 for each sequence -> [b, L] int32 index of each token's
    sequence (mamba_ssm's ``seq_idx``)."""
    return ((positions == 0).cumsum(-1) - 1).to(torch.int32)


def seq_index_of_bounds(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """[1, length] ``seq_idx`` from Megatron's ``cu_seqlens`` ([0, end of 1st, ...]); tokens past the
    last bound (a packed row's padding) are one more sequence, as Megatron's MambaMixer counts them."""
    bounds = torch.cat([cu_seqlens.long(), cu_seqlens.new_tensor([length]).long()])
    sizes = bounds[1:] - bounds[:-1]
    return torch.repeat_interleave(torch.arange(sizes.numel(), device=sizes.device), sizes)[None].int()


def causal_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, seq_idx: torch.Tensor | None = None
) -> torch.Tensor:
    """Depthwise causal conv of x [b, channels, L] with weight [channels, 1, k]; with ``seq_idx``,
    each sequence's own: every sequence is moved k-1 zeros apart from the one before, the conv runs
    over that, and each token's output is read back, so the numbers are those of each sequence alone."""
    k, length = weight.shape[-1], x.shape[-1]
    if seq_idx is None:
        return F.conv1d(x, weight, bias, padding=k - 1, groups=weight.shape[0])[..., :length]
    first = seq_idx[:, :1].long()
    at = torch.arange(length, device=x.device) + (k - 1) * (seq_idx.long() - first)  # [b, L]
    at = at[:, None].expand_as(x)
    spread = x.new_zeros(*x.shape[:2], length + (k - 1) * int((seq_idx.long() - first).max()))
    spread = spread.scatter(2, at, x)
    out = F.conv1d(spread, weight, bias, padding=k - 1, groups=weight.shape[0])
    return out.gather(2, at)


def _segsum(x: torch.Tensor) -> torch.Tensor:
    """[..., T] -> [..., T, T]: sum of x[j+1..i] below the diagonal, -inf above (stable form)."""
    t = x.shape[-1]
    x = x[..., None].expand(*x.shape, t)
    below = torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=-1)
    x = x.masked_fill(~below, 0).cumsum(dim=-2)
    return x.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device)), -torch.inf)


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    chunk: int,
    seq_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """y_t = sum_{s<=t} C_t . (prod_{s<r<=t} exp(dt_r a)) dt_s B_s x_s, chunk by chunk, in fp32; with
    ``seq_idx`` [b, l], only over the s of t's own sequence.

    x [b, l, h, p], dt [b, l, h] (already softplus'd and clamped), a [h] (negative), b/c [b, l, g, n]
    with h a multiple of g (heads share their group's B/C). Returns [b, l, h, p]."""
    batch, length, heads, _ = x.shape
    rep = heads // b.shape[2]
    x, dt = x.float(), dt.float()
    b = b.float().repeat_interleave(rep, dim=2)
    c = c.float().repeat_interleave(rep, dim=2)
    pad = (chunk - length % chunk) % chunk

    def chunks(t: torch.Tensor) -> torch.Tensor:  # [b, l, ...] -> [b, k, chunk, ...]
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.reshape(batch, -1, chunk, *t.shape[2:])

    xs, bs, cs = chunks(x * dt[..., None]), chunks(b), chunks(c)
    da = chunks(dt * a.float()).permute(0, 3, 1, 2)  # [b, h, k, chunk]
    cum = da.cumsum(-1)
    seg = _segsum(da)  # [b, h, k, chunk, chunk]
    ends = _Ends.of(seq_idx, chunk, pad)
    if ends is not None:
        seg = seg.masked_fill(ends.apart_within(), -torch.inf)
    y_diag = torch.einsum("bklhn,bkshn,bhkls,bkshp->bklhp", cs, bs, torch.exp(seg), xs)
    decay_to_end = torch.exp(cum[..., -1:] - cum)
    if ends is not None:  # a token reaches its chunk's end state only inside the sequence there
        decay_to_end = decay_to_end * ends.with_end()
    states = torch.einsum("bklhn,bhkl,bklhp->bkhpn", bs, decay_to_end, xs)
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    edges = _segsum(F.pad(cum[..., -1], (1, 0)))  # [b, h, k+1, k+1]
    if ends is not None:  # a chunk's end state passes on only while the sequence goes on
        edges = edges.masked_fill(ends.apart_across(), -torch.inf)
    states = torch.einsum("bhzc,bchpn->bzhpn", torch.exp(edges), states)[:, :-1]
    decay_in = torch.exp(cum)
    if ends is not None:  # a chunk's start state reaches only the tokens of the sequence it carries
        decay_in = decay_in * ends.with_start()
    y_off = torch.einsum("bklhn,bkhpn,bhkl->bklhp", cs, states, decay_in)
    return (y_diag + y_off).reshape(batch, -1, heads, x.shape[-1])[:, :length]


class _Ends:
    """Which tokens of a chunked packed row share a sequence: ``ids`` [b, k, chunk] (the padding past
    the row continues its last sequence) and ``carried`` [b, k+1], the sequence each chunk-end state
    belongs to (the first: the zero state before the row, given the first token's)."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids
        self.carried = torch.cat([ids[:, :1, 0], ids[:, :, -1]], dim=1)

    @classmethod
    def of(cls, seq_idx: torch.Tensor | None, chunk: int, pad: int) -> _Ends | None:
        if seq_idx is None:
            return None
        ids = torch.cat([seq_idx, seq_idx[:, -1:].expand(-1, pad)], dim=1)
        return cls(ids.reshape(ids.shape[0], -1, chunk))

    def apart_within(self) -> torch.Tensor:
        """[b, 1, k, chunk, chunk]: query and key tokens of different sequences."""
        return (self.ids[..., :, None] != self.ids[..., None, :])[:, None]

    def with_end(self) -> torch.Tensor:
        """[b, 1, k, chunk]: the token is in the sequence its chunk ends in."""
        return (self.ids == self.ids[..., -1:])[:, None]

    def apart_across(self) -> torch.Tensor:
        """[b, 1, k+1, k+1]: two chunk-end states of different sequences."""
        return (self.carried[:, :, None] != self.carried[:, None, :])[:, None]

    def with_start(self) -> torch.Tensor:
        """[b, 1, k, chunk]: the token is in the sequence its chunk's start state carries."""
        return (self.ids == self.carried[:, :-1, None])[:, None]
