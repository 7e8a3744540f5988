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

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist


class ShardWriter:
    """One rank's side of a checkpoint: ``save`` (sync, or async: returns once the state is staged to
    host memory), ``wait`` for the files, ``load`` in place."""

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self.pending: Future[Any] | None = None
        self._thread: ThreadPoolExecutor | None = None

    def save(self, state: dict[str, Any], path: str, async_save: bool) -> float:
        """Write ``state`` under ``path``; the seconds this call blocked (a previous async save
        still writing is waited for first: one save in flight).

        Async: the state is copied to host memory here (the step after this one changes the
        weights in place) and written by a background thread. torch's own ``dcp.async_save``
        stager could not copy DTensors made from local slices (torch 2.13: "invalid python storage")."""
        import torch.distributed.checkpoint as dcp

        start = time.perf_counter()
        self.wait()
        if async_save:
            staged = staged_copy(state)
            self._thread = self._thread or ThreadPoolExecutor(1, thread_name_prefix="hpcrl-ckpt")
            self.pending = self._thread.submit(dcp.save, staged, checkpoint_id=path, process_group=self.group)
        else:
            dcp.save(state, checkpoint_id=path, process_group=self.group)
        return time.perf_counter() - start

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


def staged_copy(x: Any) -> Any:
    """``x`` with every tensor copied to host memory (DTensors keep their mesh and placement)."""
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor):
        local = x.to_local().detach().to("cpu", copy=True)
        return DTensor.from_local(
            local, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride()
        )
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", copy=True)
    if isinstance(x, dict):
        return {k: staged_copy(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(staged_copy(v) for v in x)
    return x


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
