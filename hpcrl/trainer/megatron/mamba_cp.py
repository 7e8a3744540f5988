"""Context parallel for hpcrl's torch Mamba-2 mixer (``ssm.TorchMambaMixer``), after Megatron's
``MambaContextParallel`` (megatron/core/ssm/mamba_context_parallel.py).

A scan needs every earlier token, so the sequence split that attention uses cannot run it. After
``in_proj`` each CP rank holds its two of the 2·cp chunks of every sequence (chunks r and 2·cp-1-r,
Megatron's load-balanced order, ``pipeline.cp_split``) for all of this TP rank's heads. One
all-to-all over the CP group trades that for the whole sequence, in order, for heads/cp of the heads
(``to_heads``); the causal conv and the SSD scan run there on this rank's slices of the conv, A_log,
D and dt_bias (sliced in the forward, so the gradients land on the whole parameters); the inverse
all-to-all brings the scan's output back to the sequence split (``to_sequence``).

B and C follow the heads: with at least cp groups per TP rank each CP rank takes groups/cp of them,
else each group is repeated cp/groups times first, so the ranks that share a group each get a copy.
The gate ``z`` never travels: the gated norm runs after the inverse all-to-all, as Megatron's does,
so each of its groups (d_inner / n_groups channels) is whole on every rank for any cp.

The reorders are pure functions of the chunk order (``from_gather_order``, ``to_gather_order``),
unit-tested without a process group.

Imports Megatron-core: imported only where a Megatron model is built.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hpcrl.trainer.config import mamba_cp_splits
from hpcrl.trainer.ssd import causal_conv


def gather_order(cp: int) -> list[int]:
    """The global chunks in the order CP ranks hold them: rank r contributes chunks r, 2·cp-1-r."""
    return [g for r in range(cp) for g in (r, 2 * cp - 1 - r)]


def from_gather_order(t: torch.Tensor, cp: int) -> torch.Tensor:
    """Dim 0 as rank 0's two chunks, rank 1's, ... -> the sequence in order (2·cp equal chunks)."""
    where = {g: i for i, g in enumerate(gather_order(cp))}
    index = torch.tensor([where[g] for g in range(2 * cp)], device=t.device)
    return t.view(2 * cp, t.shape[0] // (2 * cp), *t.shape[1:]).index_select(0, index).flatten(0, 1)


def to_gather_order(t: torch.Tensor, cp: int) -> torch.Tensor:
    """The inverse of ``from_gather_order``: the sequence in order -> each rank's two chunks in turn."""
    index = torch.tensor(gather_order(cp), device=t.device)
    return t.view(2 * cp, t.shape[0] // (2 * cp), *t.shape[1:]).index_select(0, index).flatten(0, 1)


class MambaCP:
    """One TP rank's mixer under CP (module docstring): the head/group split and the exchanges.
    ``heads`` / ``groups`` are this TP rank's; cp = 1 makes every method the identity."""

    def __init__(self, group: Any, heads: int, groups: int, state: int, head_dim: int) -> None:
        self.group = group
        self.cp = group.size() if group is not None else 1
        self.rank = group.rank() if group is not None else 0
        if not mamba_cp_splits(heads, groups, self.cp):  # the planner's rule (megatron_build_gap)
            raise ValueError(
                f"trainer.cp={self.cp} must divide this TP rank's {heads} Mamba heads, and divide its "
                f"{groups} Mamba groups or be a multiple of them"
            )
        self.state, self.head_dim, self.groups_tp = state, head_dim, groups
        self.heads = heads // self.cp
        self.repeat = max(1, self.cp // groups)  # copies of each group, on consecutive CP ranks
        self.groups = max(1, groups // self.cp)
        self.inner = self.heads * head_dim

    # -- the two exchanges ---------------------------------------------------------------------------
    def to_heads(self, xbc: torch.Tensor, dt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[s/cp, b, x|B|C] and [s/cp, b, heads] (this rank's chunks, all TP-local heads) -> the whole
        sequence in order, [s, b, x|B|C] and [s, b, heads] of this CP rank's heads and groups."""
        if self.cp == 1:
            return xbc, dt
        from megatron.core.tensor_parallel import all_to_all

        gn = self.groups_tp * self.state
        x, b, c = xbc.split([xbc.shape[-1] - 2 * gn, gn, gn], dim=-1)
        # each piece as [s/cp, b, cp, piece/cp]: slot j is what CP rank j takes; one exchange for all
        parts = [x, self._repeat(b), self._repeat(c), dt]
        split = [p.shape[-1] // self.cp for p in parts]
        send = torch.cat([p.unflatten(-1, (self.cp, -1)) for p in parts], dim=-1)
        got = all_to_all(self.group, send.movedim(2, 0).contiguous())  # [cp (from rank), s/cp, b, ·]
        whole = from_gather_order(got.flatten(0, 1), self.cp)
        x, b, c, dt = whole.split(split, dim=-1)
        return torch.cat([x, b, c], dim=-1), dt

    def to_sequence(self, y: torch.Tensor) -> torch.Tensor:
        """[s, b, this CP rank's heads x head_dim] (sequence order) -> [s/cp, b, all TP-local heads x
        head_dim] of this rank's two chunks (the inverse of ``to_heads``)."""
        if self.cp == 1:
            return y
        from megatron.core.tensor_parallel import all_to_all

        send = to_gather_order(y, self.cp).unflatten(0, (self.cp, -1))  # slot j: rank j's chunks
        got = all_to_all(self.group, send.contiguous())  # [cp (heads of rank j), s/cp, b, inner/cp]
        return got.movedim(0, 2).flatten(2, 3)

    def _repeat(self, t: torch.Tensor) -> torch.Tensor:
        """B or C [.., groups x state] with each group repeated ``repeat`` times (fewer groups than cp)."""
        if self.repeat == 1:
            return t
        g = t.unflatten(-1, (self.groups_tp, 1, self.state))
        return g.expand(*g.shape[:-2], self.repeat, self.state).flatten(-3, -1)

    # -- this rank's slices of the mixer's parameters ---------------------------------------------------
    def per_head(self, p: torch.Tensor) -> torch.Tensor:
        """A per-head parameter (A_log, D, dt_bias) of the TP rank -> this CP rank's heads."""
        return p if self.cp == 1 else p[self.rank * self.heads : (self.rank + 1) * self.heads]

    def conv(
        self,
        xbc: torch.Tensor,
        conv: torch.nn.Conv1d,
        seq_idx: torch.Tensor | None = None,
        kernel: Any = None,
    ) -> torch.Tensor:
        """SiLU of the depthwise causal conv over [b, s, x|B|C] of this CP rank, with its channels'
        slice of the TP rank's weight and bias; ``seq_idx``: a packed row's sequences, each convolved
        alone. ``kernel``: causal_conv1d's ``causal_conv1d_fn`` (trainer/kernels.py), SiLU fused; it
        reads the channel-last [b, x|B|C, s] view as it is."""
        weight, bias = conv.weight, conv.bias
        if self.cp > 1:
            weight = self._conv_channels(weight)
            bias = None if bias is None else self._conv_channels(bias)
        if kernel is not None:  # in the activations' dtype, as autocast runs torch's conv
            w, b = weight.squeeze(1).to(xbc.dtype), None if bias is None else bias.to(xbc.dtype)
            out = kernel(xbc.transpose(1, 2), w, b, seq_idx=seq_idx, activation="silu")
            return out.transpose(1, 2)
        return F.silu(causal_conv(xbc.transpose(1, 2), weight, bias, seq_idx)).transpose(1, 2)

    def _conv_channels(self, p: torch.Tensor) -> torch.Tensor:
        """[x | B | C] rows of the TP rank -> this CP rank's x channels and its groups' B and C."""
        gn = self.groups_tp * self.state
        x, b, c = p.split([p.shape[0] - 2 * gn, gn, gn], dim=0)
        first = self.rank // self.repeat * self.groups * self.state  # this rank's first B/C channel
        take = slice(first, first + self.groups * self.state)
        x = x[self.rank * self.inner : (self.rank + 1) * self.inner]
        return torch.cat([x, b[take], c[take]], dim=0)
