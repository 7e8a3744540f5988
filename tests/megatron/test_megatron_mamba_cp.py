"""Context parallel in the megatron backend's Mamba-2 mixer (hpcrl/trainer/megatron/mamba_cp.py).

Fast: the zigzag reorders against hand-written chunk orders, and the mixer's conv + scan under CP = 2
and 4 (groups split, and groups repeated over the CP ranks) against the same at CP = 1, forward and
every gradient, with the CP ranks as threads exchanging through a fake all-to-all. Slow, under
torchrun with gloo on CPU: a small Nemotron-H at CP=2 and TP=2 x CP=2 gives the CP=1 step (log-probs,
metrics, every gradient, the updated weights)."""

from __future__ import annotations

import copy
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core")


# -- the reorders -------------------------------------------------------------------------------------
def test_zigzag_reorders_match_megatrons_chunk_order():
    """cp_split gives rank r chunks r and 2·cp-1-r: stacked in rank order they are 0 3 1 2 (cp=2),
    0 5 1 4 2 3 (cp=3); the reorders put them back in sequence order and out again."""
    from hpcrl.trainer.megatron.mamba_cp import from_gather_order, gather_order, to_gather_order

    assert gather_order(1) == [0, 1]
    assert gather_order(2) == [0, 3, 1, 2]
    assert gather_order(3) == [0, 5, 1, 4, 2, 3]
    seq = torch.arange(8)
    held = torch.tensor([0, 1, 6, 7, 2, 3, 4, 5])  # rank 0: chunks 0, 3; rank 1: chunks 1, 2
    assert torch.equal(from_gather_order(held, 2), seq)
    assert torch.equal(to_gather_order(seq, 2), held)
    for cp in (1, 3, 4):  # as pipeline.cp_split cuts [b, s] (here on dim 0, with a trailing dim)
        seq = torch.arange(8 * cp * 3).view(8 * cp, 3)
        chunks = seq.chunk(2 * cp)
        held = torch.cat([torch.cat([chunks[r], chunks[2 * cp - 1 - r]]) for r in range(cp)])
        assert torch.equal(from_gather_order(held, cp), seq), cp
        assert torch.equal(to_gather_order(seq, cp), held), cp


# -- the mixer's conv + scan, CP ranks as threads -------------------------------------------------------
class _Board:
    """An all-to-all between threads: each puts its cp parts of dim 0, takes part ``rank`` of each."""

    def __init__(self, n: int) -> None:
        self.n, self.slots = n, [torch.empty(0)] * n
        self.barrier = threading.Barrier(n, timeout=60)

    def swap(self, rank: int, t: torch.Tensor) -> torch.Tensor:
        self.slots[rank] = t
        self.barrier.wait()
        out = torch.cat([self.slots[j].chunk(self.n)[rank] for j in range(self.n)])
        self.barrier.wait()  # nobody overwrites a slot before everyone has read it
        return out


class _FakeGroup:
    def __init__(self, board: _Board, rank: int) -> None:
        self.board, self.r = board, rank

    def size(self) -> int:
        return self.board.n

    def rank(self) -> int:
        return self.r


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, t):  # type: ignore[override]
        ctx.group = group
        return group.board.swap(group.r, t.clone())

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return None, ctx.group.board.swap(ctx.group.r, grad.contiguous())


HEADS, HEAD_DIM, STATE, KERNEL, CHUNK, S, B = 8, 4, 3, 4, 8, 24, 2


def _parameters(groups: int) -> dict[str, torch.nn.Module | torch.nn.Parameter]:
    """One TP rank's conv and per-head parameters, seeded (built once: threads share the global RNG)."""
    torch.manual_seed(1)
    conv_dim = HEADS * HEAD_DIM + 2 * groups * STATE
    conv = torch.nn.Conv1d(conv_dim, conv_dim, KERNEL, groups=conv_dim, padding=KERNEL - 1)
    per_head = {k: torch.nn.Parameter(torch.randn(HEADS) * 0.5) for k in ("A_log", "D", "dt_bias")}
    return {"conv1d": conv, **per_head}


def _rank_step(groups: int, cp: int, rank: int, board: _Board | None, params: dict) -> tuple:
    """This rank's output [s/cp, b, inner] and the gradients of every parameter and input, from its
    own copy of ``params`` (what ``TorchMambaMixer._conv_scan`` reads)."""
    from hpcrl.trainer.megatron.mamba_cp import MambaCP
    from hpcrl.trainer.megatron.ssm import TorchMambaMixer

    group = _FakeGroup(board, rank) if board else None
    mcp = MambaCP(group, HEADS, groups, STATE, HEAD_DIM)
    m = SimpleNamespace(
        cp=mcp, state=STATE, head_dim=HEAD_DIM, chunk=CHUNK, dt_min=0.01, **copy.deepcopy(params)
    )
    gen = torch.Generator().manual_seed(2)
    xbc = torch.randn(S, B, m.conv1d.in_channels, generator=gen)
    dt = torch.randn(S, B, HEADS, generator=gen)
    probe = torch.randn(S, B, HEADS * HEAD_DIM, generator=gen)

    def mine(t: torch.Tensor) -> torch.Tensor:  # pipeline.cp_split on dim 0
        chunks = t.chunk(2 * cp)
        return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]])

    xbc, dt = mine(xbc).requires_grad_(), mine(dt).requires_grad_()
    xh, dth = mcp.to_heads(xbc, dt)
    y = TorchMambaMixer._conv_scan(m, xh.transpose(0, 1), dth.transpose(0, 1))  # type: ignore[arg-type]
    y = mcp.to_sequence(y.transpose(0, 1))
    (y * mine(probe)).sum().backward()
    leaves = {"conv.weight": m.conv1d.weight, "conv.bias": m.conv1d.bias, "xbc": xbc, "dt": dt}
    leaves |= {k: getattr(m, k) for k in ("A_log", "D", "dt_bias")}
    return y.detach(), {k: t.grad for k, t in leaves.items()}


@pytest.mark.parametrize(("groups", "cp"), [(4, 2), (2, 4), (1, 2)])
def test_conv_and_scan_under_cp_match_cp1(groups, cp, monkeypatch):
    """Groups split over CP (4 over 2) and repeated to it (2 over 4, 1 over 2): each rank's output
    chunks, its input gradients, and the parameter gradients summed over CP are CP=1's."""
    import megatron.core.tensor_parallel as tpar

    monkeypatch.setattr(tpar, "all_to_all", _AllToAll.apply)
    params = _parameters(groups)
    ref_y, ref_g = _rank_step(groups, 1, 0, None, params)
    board = _Board(cp)
    with ThreadPoolExecutor(cp) as pool:
        futures = [pool.submit(_rank_step, groups, cp, r, board, params) for r in range(cp)]
        runs = [f.result() for f in futures]
    chunks_y, chunks_x, chunks_dt = (ref.chunk(2 * cp) for ref in (ref_y, ref_g["xbc"], ref_g["dt"]))
    for rank, (y, grads) in enumerate(runs):
        pair = (rank, 2 * cp - 1 - rank)
        for got, ref in ((y, chunks_y), (grads["xbc"], chunks_x), (grads["dt"], chunks_dt)):
            assert torch.allclose(got, torch.cat([ref[i] for i in pair]), atol=1e-5), rank
    for name in ("conv.weight", "conv.bias", "A_log", "D", "dt_bias"):
        total = sum(g[name] for _, g in runs)
        assert torch.allclose(total, ref_g[name], atol=1e-5), name


def test_a_cp_that_splits_heads_or_groups_unevenly_is_refused():
    from hpcrl.trainer.megatron.mamba_cp import MambaCP

    with pytest.raises(ValueError, match=r"trainer.cp=3 must divide this TP rank's 8 Mamba heads"):
        MambaCP(_FakeGroup(_Board(3), 0), 8, 4, STATE, HEAD_DIM)
    with pytest.raises(ValueError, match=r"divide its 4 Mamba groups or be a multiple of them"):
        MambaCP(_FakeGroup(_Board(3), 0), 12, 4, STATE, HEAD_DIM)


def test_megatron_limits_say_what_the_mixer_splits():
    from hpcrl.config.compose import compose_config
    from hpcrl.trainer.config import megatron_build_gap

    super_ = compose_config(["model=nemotron_super"]).model  # 128 heads, 8 groups
    assert megatron_build_gap(super_, 2, 1, 4) == ""  # 4 groups per TP rank: one per CP rank
    assert megatron_build_gap(super_, 8, 1, 16) == ""  # 1 group per TP rank: a copy on each CP rank
    gap = megatron_build_gap(super_, 8, 1, 32)
    assert gap.startswith("trainer.tp=8 x trainer.cp=32 must divide nemotron_super's 128 Mamba heads")
    assert gap.endswith("use trainer.cp in 1, 2, 4, 8, 16 at trainer.tp=8")
