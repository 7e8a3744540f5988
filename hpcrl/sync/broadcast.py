"""Trainer -> rollout engine weight broadcast over a process group of its own.

After every step trainer rank 0 broadcasts the full weights (Hugging Face names) to every rollout
engine process: NCCL between GPUs, gloo on CPUs. The group is built directly from a ``TCPStore`` — never
through ``init_process_group`` — so it lives beside the trainer's own group and vLLM's, which each
own their process's default group.

Tensors travel in a few large flat buckets of one dtype each (``plan_buckets``): one collective per
bucket instead of one per tensor, and the sender casts to the dtype the engines run in (bf16 on GPUs),
so half the bytes of fp32 master weights cross the wire. Names and shapes are agreed once, when the
group is formed (``TensorMeta`` via Ray); each sync then moves raw bytes only. The receiver hands the
engine an iterator that receives bucket after bucket, so at most one bucket is in flight beside the
engine's own weights.

The other way, ``rollout.weight_sync=object_store``, ships the weights as safetensors bytes through
Ray's object store (slower; needs no connectivity between trainer and engines beyond Ray's).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

GROUP_PREFIX = "hpcrl-weights"


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Bucket:
    """Consecutive tensors sent as one flat buffer: (meta, offset) pairs and the total length."""

    entries: tuple[tuple[TensorMeta, int], ...]
    numel: int


def plan_buckets(metas: list[TensorMeta], bucket_numel: int) -> list[Bucket]:
    """Pack tensors in order into buckets of at most ``bucket_numel`` elements; a tensor larger
    than that gets a bucket of its own. Sender and receivers compute the same plan from the same
    metas, so only data crosses the wire."""
    buckets: list[Bucket] = []
    entries: list[tuple[TensorMeta, int]] = []
    used = 0
    for meta in metas:
        if entries and used + meta.numel > bucket_numel:
            buckets.append(Bucket(tuple(entries), used))
            entries, used = [], 0
        entries.append((meta, used))
        used += meta.numel
    if entries:
        buckets.append(Bucket(tuple(entries), used))
    return buckets


def metas_of(weights: dict[str, torch.Tensor]) -> list[TensorMeta]:
    return [TensorMeta(name, tuple(t.shape)) for name, t in weights.items()]


@dataclass
class WeightGroup:
    pg: Any
    store: Any
    """Kept alive with the group: rank 0's store serves the others for as long as the group lives."""

    def broadcast(self, buf: torch.Tensor) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([buf], opts).wait()

    def barrier(self, device: torch.device) -> None:
        """Every rank has reached this point (an all-reduce: a broadcast does not hold its root, which
        may finish as soon as its data sits in the peers' buffers)."""
        flag = torch.zeros(1, device=device)
        self.pg.allreduce([flag]).wait()
        if flag.is_cuda:
            torch.cuda.synchronize(device)


def new_group(
    backend: str, master: str, rank: int, world: int, *, local_ip: str, timeout_s: float = 300.0
) -> WeightGroup:
    """A process group of ``world`` ranks that rendezvous at ``master`` (host:port; rank 0 hosts the
    store). ``local_ip`` is the address this rank's gloo traffic leaves from: the node's own address,
    not whatever its hostname resolves to inside a container or network namespace."""
    import torch.distributed as dist

    host, port = master.rsplit(":", 1)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        host, int(port), world, is_master=rank == 0, timeout=timeout, wait_for_workers=False
    )
    prefixed = dist.PrefixStore(GROUP_PREFIX, store)
    group: Any
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        group = dist.ProcessGroupNCCL(prefixed, rank, world, opts)
    else:
        gloo_opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        gloo_opts._timeout = timeout
        gloo_opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_ip)]
        group = dist.ProcessGroupGloo(prefixed, rank, world, gloo_opts)
    return WeightGroup(group, store)


@dataclass
class WeightSender:
    """Trainer rank 0's end: rank 0 of the weight group."""

    group: WeightGroup
    buckets: list[Bucket]
    dtype: torch.dtype
    device: torch.device

    def send(self, weights: dict[str, torch.Tensor]) -> int:
        """Broadcast ``weights`` (the names and shapes agreed at set-up); returns the bytes sent."""
        sent = 0
        for bucket in self.buckets:
            buf = torch.empty(bucket.numel, dtype=self.dtype, device=self.device)
            for meta, offset in bucket.entries:
                src = weights[meta.name]
                if tuple(src.shape) != meta.shape:
                    raise ValueError(f"weight {meta.name}: shape {tuple(src.shape)}, agreed {meta.shape}")
                buf[offset : offset + meta.numel].copy_(src.reshape(-1), non_blocking=True)
            self.group.broadcast(buf)
            sent += buf.numel() * buf.element_size()
        return sent


@dataclass
class WeightReceiver:
    """An engine worker's end (ranks 1..N of the weight group)."""

    group: WeightGroup
    buckets: list[Bucket]
    dtype: torch.dtype
    device: torch.device

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) as buckets arrive. Consume it to the end: every bucket is a
        collective that the sender and all other receivers take part in."""
        for bucket in self.buckets:
            buf = torch.empty(bucket.numel, dtype=self.dtype, device=self.device)
            self.group.broadcast(buf)
            for meta, offset in bucket.entries:
                yield meta.name, buf[offset : offset + meta.numel].view(meta.shape)


def _buckets(metas: list[Any], bucket_numel: int) -> list[Bucket]:
    """The bucket plan from metas as they travel through Ray/RPC: (name, shape) pairs, shapes maybe lists."""
    return plan_buckets([TensorMeta(str(n), tuple(int(d) for d in s)) for n, s in metas], bucket_numel)


def join_as_sender(
    backend: str, master: str, world: int, metas: list[Any], bucket_numel: int, dtype: str, device: Any
) -> WeightSender:
    """Rank 0 (trainer rank 0): hosts the group's store at ``master`` and sends from there."""
    group = new_group(backend, master, 0, world, local_ip=master.rsplit(":", 1)[0])
    return WeightSender(group, _buckets(metas, bucket_numel), dtype_of(dtype), torch.device(device))


def join_as_receiver(
    backend: str,
    master: str,
    rank: int,
    world: int,
    metas: list[Any],
    bucket_numel: int,
    dtype: str,
    device: Any,
    local_ip: str,
) -> WeightReceiver:
    """An engine worker at ``rank`` (1..world-1), its gloo traffic leaving from ``local_ip``."""
    group = new_group(backend, master, rank, world, local_ip=local_ip)
    return WeightReceiver(group, _buckets(metas, bucket_numel), dtype_of(dtype), torch.device(device))


def dtype_of(name: str) -> torch.dtype:
    """'bfloat16' -> torch.bfloat16 (names as in the rollout config)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype
