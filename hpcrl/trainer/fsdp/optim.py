"""The fsdp backend's optimizers: AdamW or Adafactor on the FSDP2 shards, with their state kept in
bf16 or in host memory between steps (``trainer.optimizer*``).

``ShardedAdafactor`` is torch's ``Adafactor`` run on each rank's shard (FSDP2 shards every tensor on
dim 0): torch's own fails on DTensors (``aten.pow_`` on the partial norm of a sharded dim), and a
shard's statistics alone would be a different optimizer. Each tensor's sums that cross dim 0 (a
matrix's column means, the mean of its row statistics, the RMS of the weights and of the update) are
reduced over the shard group, so every rank applies the update the whole tensor would get.

``StateStore`` keeps the state in ``trainer.optimizer_dtype`` and, with ``trainer.optimizer_offload``,
in pinned host memory; it steps one tensor at a time, its state brought to the GPU in fp32 and put
back after, so the GPU holds one tensor's state at most.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from hpcrl.config.schema import RunConfig
from hpcrl.trainer.config import Optimizer, Precision


def make_optimizer(params: list[torch.nn.Parameter], cfg: RunConfig, device: str) -> torch.optim.Optimizer:
    """``trainer.optimizer`` over ``params`` at ``algo.lr``."""
    t = cfg.trainer
    if t.optimizer is Optimizer.adafactor:
        return ShardedAdafactor(params, lr=cfg.algo.lr, weight_decay=t.weight_decay)
    return torch.optim.AdamW(
        params,
        lr=cfg.algo.lr,
        weight_decay=t.weight_decay,
        betas=t.adamw_betas(),
        fused=device.startswith("cuda") or None,  # one kernel per step instead of ~10 per tensor list
    )


def _local(t: torch.Tensor) -> tuple[torch.Tensor, list[dist.ProcessGroup]]:
    """A tensor's local shard and the groups its dim-0 shards span, one a mesh dim (none: whole
    here). Expert weights under ``trainer.ep`` are split on dim 0 twice, over EP and (strided) over
    expert DP: which rows a rank holds does not matter to sums over all of them."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t, []
    mesh, groups = t.device_mesh, []
    for i, placement in enumerate(t.placements):
        if placement.is_replicate():
            continue
        if getattr(placement, "dim", None) != 0:  # Shard(0) or _StridedShard(0)
            raise ValueError(f"ShardedAdafactor takes tensors sharded on dim 0 (FSDP2), not {t.placements}")
        groups.append(mesh.get_group(i) if mesh.ndim > 1 else mesh.get_group())
    return t.to_local(), groups


def _sum(values: list[torch.Tensor], groups: list[dist.ProcessGroup]) -> list[torch.Tensor]:
    """Each of ``values`` summed over the shards of ``groups`` (one collective a group for all)."""
    if not groups:
        return values
    flat = torch.cat([v.reshape(-1) for v in values])
    for group in groups:
        dist.all_reduce(flat, group=group)
    return list(flat.split([v.numel() for v in values]))


def _like(p: torch.Tensor, local: torch.Tensor, shape: list[int], replicated: bool) -> torch.Tensor:
    """State ``local`` (this rank's part) as a DTensor beside ``p``: sharded on dim 0 as ``p`` is, of
    global ``shape``, or the same on every rank (``replicated``)."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(p, DTensor):
        return local
    placements = [Replicate()] * p.device_mesh.ndim if replicated else list(p.placements)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        local, p.device_mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride
    )


class ShardedAdafactor(torch.optim.Optimizer):
    """torch's ``Adafactor`` (the same hyperparameters and state names) on dim-0 shards."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        lr: float = 1e-2,
        beta2_decay: float = -0.8,
        eps: tuple[float | None, float] = (None, 1e-3),
        d: float = 1.0,
        weight_decay: float = 0.0,
    ) -> None:
        defaults = {"lr": lr, "beta2_decay": beta2_decay, "eps": eps, "d": d, "weight_decay": weight_decay}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        assert closure is None, "no closures"
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._step_one(p, group)

    def _init_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        local = p.to_local() if hasattr(p, "to_local") else p
        state = {"step": torch.tensor(0.0, dtype=torch.float32)}
        if p.dim() < 2:
            state["variance"] = _like(p, torch.zeros_like(local), list(p.shape), False)
            return state
        rows, cols = list(p.shape), list(p.shape)
        rows[-1], cols[-2] = 1, 1
        local_rows, local_cols = list(local.shape), list(local.shape)
        local_rows[-1], local_cols[-2] = 1, 1
        state["row_var"] = _like(p, local.new_zeros(local_rows), rows, False)
        # a matrix's column statistics span the sharded dim: the same on every rank
        state["col_var"] = _like(p, local.new_zeros(local_cols), cols, p.dim() == 2)
        return state

    def _step_one(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        state = self.state[p]
        if not state:
            state.update(self._init_state(p))
        param, shards = _local(p)
        grad, _ = _local(p.grad)  # type: ignore[arg-type]
        lr, wd, d = group["lr"], group["weight_decay"], group["d"]
        eps1, eps2 = group["eps"]
        eps1 = torch.finfo(param.dtype).eps if eps1 is None else eps1
        state["step"] += 1
        step = state["step"].item()
        beta = step ** group["beta2_decay"]  # 1 - beta2 at this step
        rho = min(lr, 1 / step**0.5)
        numel = p.numel()
        across = shards if p.dim() == 2 else []  # only a matrix's dim -2 is the sharded dim
        if p.dim() >= 2:
            row_var, _ = _local(state["row_var"])
            col_var, _ = _local(state["col_var"])
            row_var.lerp_(grad.square().sum(-1, keepdim=True) / grad.size(-1), beta)
            col_sq, row_sum = grad.square().sum(-2, keepdim=True), row_var.sum(-2, keepdim=True)
            if across:
                col_sq, row_sum = _sum([col_sq, row_sum], across)
                col_sq, row_sum = col_sq.view(col_var.shape), row_sum.view(1, 1)
            col_var.lerp_(col_sq / p.shape[-2], beta)
            var_estimate = (row_var @ col_var).div_((row_sum / p.shape[-2]).clamp_(min=eps1))
        else:
            variance, _ = _local(state["variance"])
            variance.lerp_(grad * grad, beta)
            var_estimate = variance.clone()
        (param_sq,) = _sum([param.square().sum().reshape(1)], shards)
        alpha = max(eps2, param_sq.sqrt().item() / numel**0.5) * rho
        if wd != 0:
            param.mul_(1 - lr * wd)
        update = var_estimate.clamp_(min=eps1 * eps1).rsqrt_().mul_(grad)
        (update_sq,) = _sum([update.square().sum().reshape(1)], shards)
        denom = max(1.0, update_sq.sqrt().item() / (numel**0.5 * d))
        param.add_(update, alpha=-alpha / denom)


class StateStore:
    """Steps ``optimizer`` one tensor at a time with its state kept, between steps, in ``dtype`` and
    (``host``) in pinned host memory: the state of the tensor being stepped is brought to the GPU in
    fp32, stepped, and put back (rounded stochastically to bf16: its expected value is the fp32 one,
    so updates below bf16's precision still land on average). Checkpoints write the state as kept
    and load into it in place (``create``); an optimizer ``load_state_dict``, which casts the state
    to the parameters' dtype and device, is put back as kept after it."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: RunConfig, device: str, rank: int) -> None:
        t = cfg.trainer
        self.optimizer, self.device = optimizer, torch.device(device)
        self.host = t.optimizer_offload
        self.dtype = torch.bfloat16 if t.optimizer_dtype is Precision.bfloat16 else torch.float32
        self.active = self.host or self.dtype != torch.float32
        self.seed = (cfg.run.seed, rank)
        self.generator = torch.Generator(device=self.device)
        self.index = {p: i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
        """Each parameter's place, which with the step count seeds its rounding: a resumed run rounds
        as the uninterrupted one does."""
        self._stepping = False
        if self.active:
            optimizer.register_load_state_dict_post_hook(lambda _: self.put_all())
            # torch's state-dict helpers may step a fresh optimizer once to create its state
            optimizer.register_step_post_hook(lambda *_: None if self._stepping else self.put_all())

    def step(self) -> None:
        if not self.active:
            self.optimizer.step()
            return
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        grads = [p.grad for p in params]
        self._stepping = True
        try:
            for p in params:
                p.grad = None
            for p, grad in zip(params, grads, strict=True):
                p.grad = grad
                self._take(p)
                self.optimizer.step()
                self._put(p)
                p.grad = None
        finally:
            for p, grad in zip(params, grads, strict=True):
                p.grad = grad
            self._stepping = False
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the host copies are complete

    def create(self) -> None:
        """Every tensor's state, as kept, before a checkpoint is loaded into it: a step at rate 0 on
        zero gradients, one tensor at a time (torch's state-dict helpers would take the same step on
        the whole optimizer, with all of its state on the GPU at once)."""
        if self.optimizer.state or not self.active:
            return
        rates = [g["lr"] for g in self.optimizer.param_groups]
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        for g in self.optimizer.param_groups:
            g["lr"] = 0.0
        for p in params:
            p.grad = torch.zeros_like(p)
        self.step()
        for p in params:
            p.grad = None
        for g, lr in zip(self.optimizer.param_groups, rates, strict=True):
            g["lr"] = lr

    def put_all(self) -> None:
        """Every tensor's state as kept (after a load or a first step outside ``step``)."""
        for p in list(self.optimizer.state):
            self._put(p)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _kept(self, state: dict[str, Any]) -> list[str]:
        """The state the store keeps: tensors (not the scalar step counts, which stay as the optimizer
        made them)."""
        return [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0]

    def _take(self, p: torch.Tensor) -> None:
        state = self.optimizer.state[p]
        for key in self._kept(state):
            kept = state[key]
            local = _as_local(kept).to(self.device, torch.float32, non_blocking=True)
            state[key] = _rewrap(kept, local)

    def _put(self, p: torch.Tensor) -> None:
        state = self.optimizer.state[p]
        for i, key in enumerate(self._kept(state)):
            value = state[key]
            local = _as_local(value)
            if local.dtype == self.dtype and local.device.type == self._home():
                continue  # already kept
            if self.dtype == torch.bfloat16 and local.dtype != torch.bfloat16:
                step = int(state["step"]) if "step" in state else 0
                self.generator.manual_seed(hash((*self.seed, step, self.index[p], i)) & (2**62 - 1))
                local = _round_bf16(local, self.generator)
            kept = torch.empty_like(local, dtype=self.dtype, device=self._home(), pin_memory=self._pin())
            kept.copy_(local, non_blocking=True)
            state[key] = _rewrap(value, kept)

    def _home(self) -> str:
        return "cpu" if self.host else self.device.type

    def _pin(self) -> bool:
        return self.host and self.device.type == "cuda"


def _as_local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _rewrap(like: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` in place of ``like``'s local tensor, with ``like``'s sharding. Built directly (as
    FSDP2's own CPU offload builds its host-resident shards): ``from_local`` would move a host
    tensor to the mesh's device."""
    from torch.distributed.tensor import DTensor

    if not isinstance(like, DTensor):
        return local
    return DTensor(local, like._spec, requires_grad=False)


def _round_bf16(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """fp32 -> bf16, rounded up or down with the probabilities that make the expected value ``x``:
    random low 16 bits added to the fp32 bits, then cut off."""
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, generator=generator, device=x.device, dtype=torch.int32)
    return (bits + noise).bitwise_and_(-65536).view(torch.float32).to(torch.bfloat16)
