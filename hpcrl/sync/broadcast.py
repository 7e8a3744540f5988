"""Trainer -> rollout engine weight broadcast over process groups of their own.

After every step each *sending* trainer rank broadcasts its part of the weights (Hugging Face names)
to every rollout engine worker: fsdp's rank 0 (each tensor gathered over data parallel as its bucket
is packed), or under Megatron each pipeline stage's first rank its stage's layers and each
expert-parallel rank's first rank its experts — so no rank ever holds the whole model. Each sender
has a group of its own with the engine workers (NCCL between GPUs, gloo on CPUs): the stages send
without funnelling through one rank. The groups are built directly from a ``TCPStore`` — never
through ``init_process_group`` — so they live beside the trainer's own group and vLLM's.

Tensors travel in flat buckets of the engines' dtype (``plan_buckets``), packed by sync/packer.py
while the previous bucket is on the wire. What every member must agree on — who sends which tensors,
in which order, dtype and bucket size, and where each group meets — is one value, ``WeightLayout``,
formed once (names and shapes from parameter metadata); each sync then moves raw bytes only. The
receiver hands the engine an iterator that receives bucket after bucket, sender after sender.

The other ways: ``rollout.weight_sync=object_store`` ships the same buckets through Ray's object
store; colocated GPUs hand the engine CUDA IPC handles of the buckets (run/fleet.py decides).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from hpcrl.sync.packer import Bucket, BucketPacker, TensorMeta, let_go, plan_buckets

GROUP_PREFIX = "hpcrl-weights"


@dataclass
class WeightGroup:
    pg: Any
    store: Any
    """Kept alive with the group: rank 0's store serves the others for as long as the group lives."""

    def broadcast(self, buf: torch.Tensor) -> None:
        self.broadcast_async(buf).wait()

    def broadcast_async(self, buf: torch.Tensor) -> Any:
        """From rank 0; the work to ``wait`` on (the buffer must live until then)."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        return self.pg.broadcast([buf], opts)

    def close(self) -> None:
        """Drop the group and its store: their connections close, so every peer still waiting in a
        collective of it fails at once (a gloo broadcast whose receiver died leaves the others
        waiting for the group's timeout otherwise: measured, 30 of 30 s)."""
        self.pg = None
        self.store = None

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
    """A sending trainer rank's end: rank 0 of its own group."""

    group: WeightGroup
    buckets: list[Bucket]
    dtype: torch.dtype
    device: torch.device

    def packer(self) -> BucketPacker:
        """A sink for one stream (``Trainer.stream_weights``): each full bucket is broadcast while
        the next is packed; ``finish()`` waits for the last and returns the stream's costs. A failed
        broadcast (a receiver died) closes the group: the packer's ``failed`` says why."""
        return BucketPacker(self.buckets, self.dtype, self.device, self._emit, on_fail=self._failed)

    def _failed(self) -> None:
        self.group.close()

    def _emit(self, buf: torch.Tensor, bucket: Bucket) -> Any:
        return _Sent(self.group.broadcast_async(buf), buf)

    def send(self, weights: dict[str, torch.Tensor]) -> int:
        """Broadcast ``weights`` whole (tests; small models); returns the bytes sent."""
        packer = self.packer()
        for bucket in self.buckets:
            for meta, _ in bucket.entries:
                if meta.name not in weights:
                    raise ValueError(f"weight {meta.name}: missing from what was sent")
                packer.put(meta.name, weights[meta.name])
        return packer.finish().bytes


@dataclass
class _Sent:
    """A bucket's broadcast: done once the data went out and the backend let go of the buffer (gloo
    keeps it a moment longer: ``let_go``), so that freeing the bucket frees it."""

    work: Any
    buf: torch.Tensor

    def wait(self) -> None:
        try:
            self.work.wait()
        finally:
            self.work = None  # its own hold on the buffer (and on the group) goes with it
        let_go(self.buf)


@dataclass
class WeightReceiver:
    """An engine worker's end (ranks 1..N of every source's group)."""

    groups: list[WeightGroup]
    plans: list[list[Bucket]]
    dtype: torch.dtype
    device: torch.device
    receive_s: float = 0.0
    """Seconds spent in the broadcasts of the last ``timed`` receive."""

    @property
    def buckets(self) -> int:
        return sum(len(p) for p in self.plans)

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) as buckets arrive, source after source. Consume it to the end: every
        bucket is a collective that its sender and all other receivers take part in."""
        for bucket in self.receive_buckets():
            yield from bucket.items()

    def timed(self, load: Callable[[], object]) -> dict[str, float]:
        """Run ``load`` (which consumes ``receive``): seconds on the wire vs in the engine's load."""
        self.receive_s, start = 0.0, time.perf_counter()
        load()
        total = time.perf_counter() - start
        return {"receive_s": self.receive_s, "load_s": total - self.receive_s, "buckets": float(self.buckets)}

    def receive_buckets(self) -> Iterator[dict[str, torch.Tensor]]:
        """Bucket after bucket: views into one received buffer each."""
        for group, plan in zip(self.groups, self.plans, strict=True):
            for bucket in plan:
                buf = torch.empty(bucket.numel, dtype=self.dtype, device=self.device)
                start = time.perf_counter()
                group.broadcast(buf)
                self.receive_s += time.perf_counter() - start
                yield {m.name: buf[o : o + m.numel].view(m.shape) for m, o in bucket.entries}


@dataclass(frozen=True)
class WeightLayout:
    """What the senders and every engine worker agree on before the first sync."""

    sources: tuple[tuple[int, tuple[TensorMeta, ...]], ...]
    """(trainer rank, the tensors it sends in order), in the order the engines receive them."""
    dtype: str
    bucket_numel: int
    backend: str = "gloo"
    masters: tuple[str, ...] = ()
    """host:port of each source's group (its store lives on the source's node)."""
    engine_ranks: int = 0
    """Engine workers in every group (ranks 1..engine_ranks; the source is rank 0)."""

    @classmethod
    def of(
        cls, per_rank: list[list[tuple[str, tuple[int, ...]]]], dtype: str, bucket_numel: int
    ) -> WeightLayout:
        """From every trainer rank's ``weight_metas`` (rank order); a name sent by two ranks is a bug."""
        sources: list[tuple[int, tuple[TensorMeta, ...]]] = []
        seen: set[str] = set()
        for rank, metas in enumerate(per_rank):
            if metas:
                typed = tuple(TensorMeta(str(n), tuple(int(d) for d in s)) for n, s in metas)
                twice = seen & {m.name for m in typed}
                if twice:
                    raise ValueError(f"weights sent by two trainer ranks: {sorted(twice)[:3]}")
                seen |= {m.name for m in typed}
                sources.append((rank, typed))
        return cls(tuple(sources), dtype, bucket_numel)

    def buckets(self, index: int) -> list[Bucket]:
        return plan_buckets(list(self.sources[index][1]), self.bucket_numel)

    @property
    def numel(self) -> int:
        return sum(m.numel for _, metas in self.sources for m in metas)

    @property
    def names(self) -> list[str]:
        return [m.name for _, metas in self.sources for m in metas]

    @property
    def world(self) -> int:
        return 1 + self.engine_ranks

    def source_index(self, rank: int) -> int | None:
        return next((i for i, (r, _) in enumerate(self.sources) if r == rank), None)

    def wire(self) -> dict[str, Any]:
        """Plain types (Ray and vLLM's RPC carry it)."""
        return {
            "sources": [[r, [[m.name, list(m.shape)] for m in metas]] for r, metas in self.sources],
            "dtype": self.dtype,
            "bucket_numel": self.bucket_numel,
            "backend": self.backend,
            "masters": list(self.masters),
            "engine_ranks": self.engine_ranks,
        }

    @classmethod
    def from_wire(cls, w: dict[str, Any]) -> WeightLayout:
        sources = tuple(
            (int(r), tuple(TensorMeta(str(n), tuple(int(d) for d in s)) for n, s in metas))
            for r, metas in w["sources"]
        )
        return cls(
            sources,
            str(w["dtype"]),
            int(w["bucket_numel"]),
            str(w["backend"]),
            tuple(w["masters"]),
            int(w["engine_ranks"]),
        )


def join_as_sender(layout: WeightLayout, rank: int, device: Any) -> WeightSender:
    """Trainer rank ``rank`` (a source): hosts its group's store and sends from there."""
    index = layout.source_index(rank)
    if index is None:
        raise ValueError(f"trainer rank {rank} sends no weights")
    master = layout.masters[index]
    group = new_group(layout.backend, master, 0, layout.world, local_ip=master.rsplit(":", 1)[0])
    return WeightSender(group, layout.buckets(index), dtype_of(layout.dtype), torch.device(device))


def join_as_receiver(layout: WeightLayout, rank: int, device: Any, local_ip: str) -> WeightReceiver:
    """An engine worker at ``rank`` (1..engine_ranks) of every source's group, its gloo traffic
    leaving from ``local_ip``."""
    groups = [
        new_group(layout.backend, master, rank, layout.world, local_ip=local_ip) for master in layout.masters
    ]
    plans = [layout.buckets(i) for i in range(len(layout.sources))]
    return WeightReceiver(groups, plans, dtype_of(layout.dtype), torch.device(device))


def dtype_of(name: str) -> torch.dtype:
    """'bfloat16' -> torch.bfloat16 (names as in the rollout config)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype
