"""Packing the trainer's weight stream into buckets, two at a time.

A trainer's ``stream_weights`` hands over one gathered tensor after another (``WeightSink``); the
packer copies each into the current bucket (a flat buffer of the engines' dtype, laid out by the
agreed ``Bucket`` plan) and, when the bucket is full, hands it to ``emit`` — a broadcast to the
engines, a CUDA IPC handle to the engine on the same GPU, or a message through Ray's object store —
which returns something to ``wait`` on. While one bucket is on its way the next is packed
(double buffering: gathering overlaps sending).

Memory is bounded by construction, not by hope: the packer counts what it and the trainer hold —
the bucket in flight, the one being packed, and the trainer's scratch for the tensor being gathered
(``scratch``) — and before anything new is allocated it waits for the bucket in flight whenever the
total would pass two buckets. A tensor larger than a bucket gets a bucket of its own (then it alone
sets the peak).

A send that fails (a receiving engine died mid-refit) stops the sending, not the stream: the trainer's
ranks gather together, so the sender goes on taking part until the end, and ``failed`` says why
(``on_fail`` runs at once: a broadcast closes its group, so the other receivers stop waiting).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


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


class Pending(Protocol):
    def wait(self) -> Any: ...


Emit = Callable[[torch.Tensor, Bucket], Pending]


@dataclass
class PackStats:
    """What one stream cost the sender: seconds packing (gathering and copying), seconds waiting on
    sends, bytes handed to ``emit``, and the most elements it counted held at once."""

    pack_s: float = 0.0
    wait_s: float = 0.0
    bytes: int = 0
    peak_numel: int = 0
    buckets: int = 0


@dataclass
class _Flight:
    pending: Pending
    buf: torch.Tensor


@dataclass
class BucketPacker:
    """A ``WeightSink`` over one sender's bucket plan (sync/broadcast.py ``plan_buckets``)."""

    buckets: list[Bucket]
    dtype: torch.dtype
    device: torch.device
    emit: Emit
    stats: PackStats = field(default_factory=PackStats)
    on_fail: Callable[[], None] | None = None
    failed: str | None = None
    """The first send's error, in one line; nothing is sent after it."""

    def __post_init__(self) -> None:
        self.budget = 2 * max((b.numel for b in self.buckets), default=0)
        self._entries = self._plan()
        self._current: torch.Tensor | None = None
        self._flight: _Flight | None = None
        self._scratch = 0
        self._started = time.perf_counter()

    def _plan(self) -> Iterator[tuple[int, Any, int]]:
        for i, bucket in enumerate(self.buckets):
            for meta, offset in bucket.entries:
                yield i, meta, offset

    # -- WeightSink ---------------------------------------------------------------------------------
    @contextmanager
    def scratch(self, numel: int) -> Iterator[None]:
        self._make_room(numel)
        self._scratch += numel
        self._note()
        try:
            yield
        finally:
            self._scratch -= numel

    def put(self, name: str, tensor: torch.Tensor) -> None:
        try:
            index, meta, offset = next(self._entries)
        except StopIteration:
            raise ValueError(f"weight {name}: the stream sent more tensors than were agreed") from None
        if meta.name != name or tuple(tensor.shape) != meta.shape:
            raise ValueError(
                f"weight stream out of step: got {name} {tuple(tensor.shape)}, agreed {meta.name} {meta.shape}"
            )
        bucket = self.buckets[index]
        if self._current is None:
            self._make_room(bucket.numel)
            self._current = torch.empty(bucket.numel, dtype=self.dtype, device=self.device)
            self._note()
        self._current[offset : offset + meta.numel].view(meta.shape).copy_(tensor)
        if offset + meta.numel == bucket.numel:
            self._launch(bucket)

    # -- the end of a stream --------------------------------------------------------------------------
    def finish(self) -> PackStats:
        """Every agreed tensor was put; wait for the last bucket. The stats of the whole stream."""
        left = next(self._entries, None)
        if left is not None:
            raise ValueError(
                f"weight stream ended before {left[1].name}: the trainer sent fewer tensors than agreed"
            )
        self._wait()
        self.stats.pack_s = time.perf_counter() - self._started - self.stats.wait_s
        return self.stats

    # -- internals ----------------------------------------------------------------------------------
    def _held(self) -> int:
        flying = self._flight.buf.numel() if self._flight else 0
        current = self._current.numel() if self._current is not None else 0
        return flying + current + self._scratch

    def _note(self) -> None:
        self.stats.peak_numel = max(self.stats.peak_numel, self._held())

    def _make_room(self, numel: int) -> None:
        if self._flight is not None and self._held() + numel > self.budget:
            self._wait()

    def _launch(self, bucket: Bucket) -> None:
        assert self._current is not None
        self._wait()  # one bucket in flight at a time: at most two buffers live
        if self.failed is not None:
            self._current = None
            return
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # copies done before another process reads
        try:
            self._flight = _Flight(self.emit(self._current, bucket), self._current)
        except Exception as exc:
            self._fail(exc)
            self._current = None
            return
        self.stats.bytes += self._current.numel() * self._current.element_size()
        self.stats.buckets += 1
        self._current = None

    def _wait(self) -> None:
        if self._flight is None:
            return
        start = time.perf_counter()
        try:
            self._flight.pending.wait()
        except Exception as exc:
            self._fail(exc)
        self.stats.wait_s += time.perf_counter() - start
        self._flight = None

    def _fail(self, exc: Exception) -> None:
        lines = [line for line in str(exc).splitlines() if line.strip()]
        self.failed = f"{type(exc).__name__}: {lines[-1] if lines else ''}"
        if self.on_fail is not None:
            self.on_fail()


LET_GO_S = 1.0
"""The longest ``let_go`` waits (gloo took up to 117 ms when measured on a loaded machine)."""


def let_go(*tensors: torch.Tensor) -> None:
    """Return once the caller alone holds each CPU tensor of ``tensors``, so that dropping them
    frees them. gloo's worker thread keeps a finished collective's tensors a moment after the
    caller's wait returned — measured on a 2-core machine: 1 in 4 broadcasts of 2 MiB (up to
    5 ms), 1 in 3 gathers and all-gathers (up to 117 ms under load) — and whatever the stream
    allocates meanwhile comes on top of memory it counted as freed. Bounded by ``LET_GO_S``."""
    deadline = time.perf_counter() + LET_GO_S
    for t in tensors:
        if t.device.type != "cpu":
            continue
        # one owner: the caller's tensor (torch's count of a tensor's owners; not in its stubs)
        while t._use_count() > 1 and time.perf_counter() < deadline:  # type: ignore[attr-defined]
            time.sleep(50e-6)


@dataclass
class RayWait:
    """A send that is a Ray call (or several): done when they returned."""

    refs: list[Any]

    def wait(self) -> Any:
        import ray

        return ray.get(self.refs)


def _entries(bucket: Bucket) -> list[tuple[str, tuple[int, ...], int]]:
    return [(meta.name, meta.shape, offset) for meta, offset in bucket.entries]


def ipc_emit(engines: list[Any]) -> Emit:
    """Buckets to the engines on this GPU as CUDA IPC handles: each maps the sender's buffer, copies
    the weights out into its own, and answers when done (so the buffer may be freed or reused)."""

    def emit(buf: torch.Tensor, bucket: Bucket) -> Pending:
        from torch.multiprocessing.reductions import reduce_tensor

        args = reduce_tensor(buf)[1]  # the rebuild arguments alone: the function is known at the other end
        entries = _entries(bucket)
        return RayWait([engine.load_ipc.remote(args, entries) for engine in engines])

    return emit


def store_emit(engines: list[Any]) -> Emit:
    """Buckets through Ray's object store: one host copy, put once, loaded by every engine."""

    def emit(buf: torch.Tensor, bucket: Bucket) -> Pending:
        import ray

        host = buf.cpu()
        tensors = {name: host[o : o + math.prod(shape)].view(shape) for name, shape, o in _entries(bucket)}
        ref = ray.put(tensors)
        return RayWait([e.load_weights.remote(ref) for e in engines])

    return emit
