"""The training ranks' process groups, set up the same way by every backend (fsdp/, megatron/):
the world group over a TCP rendezvous, the collective library the device asks for, and subgroups
that every rank creates in the same order."""

from __future__ import annotations

import socket
from collections.abc import Sequence

import torch.distributed as dist


def collective_backend(device: str) -> str:
    """NCCL between GPUs, gloo on CPUs."""
    return "nccl" if device.startswith("cuda") else "gloo"


def init_process_group(rank: int, world: int, master: str, backend: str) -> None:
    """Join the training ranks' world group at ``master`` (host:port); a no-op where this process
    has one already (torchrun's environment, a test that made its own)."""
    if dist.is_initialized():
        return
    dist.init_process_group(backend=backend, init_method=f"tcp://{master}", rank=rank, world_size=world)


def own_group(groups: Sequence[Sequence[int]]) -> dist.ProcessGroup:
    """Every rank creates every one of ``groups`` (torch asks it, in the same order on all ranks) and
    keeps the one it is in."""
    made = [(ranks, dist.new_group(list(ranks))) for ranks in groups]
    rank = dist.get_rank()
    return next(group for ranks, group in made if rank in ranks)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (for a rendezvous address)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
