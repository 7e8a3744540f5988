"""Trainer checkpoints as torch.distributed.checkpoint (DCP) shards: every rank writes its own part
straight into the checkpoint directory, and a run with another layout reads the parts it needs.

DCP serves both backends: one format and one reader (``hpcrl export`` reads either on a login node
with no process group), resharding by torch (each saved chunk's offsets are in ``.metadata``), and
async saves. Megatron's dist-checkpointing was the other choice; it asks every module for a
``sharded_state_dict``, which the contained stand-ins (megatron/ssm.py) do not have, and its
checkpoints are read back through Megatron only.

The fsdp backend saves torch's own sharded state dict (FSDP2 DTensors, optimizer state keyed by
parameter name); the megatron backend lays its TP slices out as DTensors of one layout-free model
(megatron/sharded.py). Saves and loads run over a gloo group of their own, so an async save's
background thread never shares a communicator with training.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpcrl.core.files import crc32_of


class ShardWriter:
    """One rank's side of a checkpoint: ``save`` (sync, or async: returns once the state is staged to
    host memory), ``wait`` for the files, ``load`` in place."""

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self.pending: Future[Any] | None = None
        self._thread: ThreadPoolExecutor | None = None
        self._staging: dict[str, torch.Tensor] = {}
        """Host copies of this rank's state, kept from one async save to the next (pinned for GPU
        tensors): the first save allocates them, later ones only copy (measured on one H200: fresh
        pageable copies ran at 1.2 GB/s)."""

    def save(self, state: dict[str, Any], path: str, async_save: bool) -> float:
        """Write ``state`` under ``path``; the seconds this call blocked (a previous async save
        still writing is waited for first: one save in flight).

        Async: the state is copied to host memory here (the step after this one changes the
        weights in place) and written by a background thread; the host copy (the size of this
        rank's shards) stays allocated for the next save. torch's own ``dcp.async_save`` stager
        could not copy DTensors made from local slices (torch 2.13: "invalid python storage")."""

        start = time.perf_counter()
        self.wait()
        if async_save:
            staged = staged_copy(state, self._staging)
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the copies were issued non-blocking
            self._thread = self._thread or ThreadPoolExecutor(1, thread_name_prefix="hpcrl-ckpt")
            self.pending = self._thread.submit(self._write, staged, path)
        else:
            self._write(state, path)
        return time.perf_counter() - start

    def _write(self, state: dict[str, Any], path: str) -> None:
        """The shards, then this rank's record of them (size and CRC-32 of each file it wrote, summed
        while they are still in the page cache): the commit's manifest (run/checkpoint.py) reads these
        records instead of the shards."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            dcp.save(state, checkpoint_id=path, process_group=self.group)
        except CheckpointException as exc:  # a BaseException: Ray's actors and the driver take Exceptions
            raise rank_failure(exc) from None
        rank = dist.get_rank(self.group) if self.group is not None else 0
        mine = sorted(Path(path).glob(f"__{rank}_*.distcp"))
        record = {f.name: {"size": f.stat().st_size, "crc32": crc32_of(f)} for f in mine}
        (Path(path) / f".crc_{rank}.json").write_text(json.dumps(record))

    def wait(self) -> float:
        """Block until the async save in flight (if any) has written its files; the seconds waited.
        A failed write raises here."""
        start = time.perf_counter()
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()
        return time.perf_counter() - start

    def load(self, state: dict[str, Any], path: str) -> None:
        """Fill ``state``'s tensors in place from ``path`` (each rank reads the chunks its own
        tensors overlap, whatever layout wrote them)."""
        import torch.distributed.checkpoint as dcp

        self.wait()
        dcp.load(state, checkpoint_id=path, process_group=self.group)


def rank_failure(exc: BaseException) -> Exception:
    """What failed on the first rank that failed (a full disk's OSError, to name one), as DCP's
    ``CheckpointException`` holds it: the checkpoint manager reads its errno."""
    for failure in getattr(exc, "failures", {}).values():
        if isinstance(inner := getattr(failure, "exc", None), Exception):
            return inner
    return RuntimeError((str(exc).splitlines() or ["checkpoint write failed"])[0])


def staged_copy(x: Any, buffers: dict[str, torch.Tensor], key: str = "") -> Any:
    """``x`` with every tensor copied into host ``buffers`` (reused when shape and dtype match;
    DTensors keep their mesh and placement). GPU copies are issued non-blocking: synchronise after."""
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor):
        local = _stage(x.to_local(), buffers, key)
        return DTensor.from_local(
            local, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride()
        )
    if isinstance(x, torch.Tensor):
        return _stage(x, buffers, key)
    if isinstance(x, dict):
        return {k: staged_copy(v, buffers, f"{key}/{k}") for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(staged_copy(v, buffers, f"{key}/{i}") for i, v in enumerate(x))
    return x


def _stage(t: torch.Tensor, buffers: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    buf = buffers.get(key)
    if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
        buf = buffers[key] = _host_buffer(t)
    buf.copy_(t.detach(), non_blocking=buf.is_pinned())
    return buf


def _host_buffer(t: torch.Tensor) -> torch.Tensor:
    """Pinned for a GPU tensor (full-speed DMA); pageable where the driver refuses more pinned
    memory (seen on an H200 host: "NVRM: failed to allocate page table" past ~50 GB pinned)."""
    if t.is_cuda:
        try:
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        except RuntimeError:
            pass
    return torch.empty(t.shape, dtype=t.dtype)


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter its (zero) Adam state, so a load has tensors to fill: one step with zero
    gradients at learning rate 0 moves no weight (decoupled decay is scaled by the rate too)."""
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    grads = [p.grad for p in params]
    lrs = [g["lr"] for g in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs, strict=True):
        g["lr"] = lr
    for p, grad in zip(params, grads, strict=True):
        p.grad = grad
