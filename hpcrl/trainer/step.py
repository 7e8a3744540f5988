"""One training step, written once for every backend: minibatches, micro-batches, token shares,
the loss call, metric sums, and the order of zeroing, backward, clipping and stepping.

Each rank trains on its shard of the batch, where it lives: with a KL term (``algo.kl_coef`` > 0)
the frozen reference policy scores the shard first, on this rank's own copy of it. When a batch
takes several optimizer steps (``algo.num_minibatches`` > 1) the policy that generated the rollouts
is scored next (the "old" log-probs). Each minibatch: gradients zeroed, its rows cut into
micro-batches, forward and backward over them with ``PolicyLoss`` weighted by each micro-batch's
share of what the loss averages over in the minibatch (its loss tokens, or for a sequence-level
``algo.loss_agg`` its sequences: so accumulation gives the whole minibatch's value), then the
gradients are clipped and the optimizer steps. Metrics are those share-weighted sums, averaged over
the minibatches; entropy and ``gen_kl_error`` (the rollout engine's log-probs against the old
policy's) are token means. Over data-parallel ranks (``StepBackend.data_group``) each minibatch's
means are combined by their weights, the loss units or tokens each rank's shard held there: the
metrics describe the whole batch, as one rank training on all of it would log them.

A backend implements ``StepBackend``: its forward (log-probs and entropy of micro-batches, however
it computes them: fsdp's model call, megatron's pipeline schedule) and its optimizer step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch
import torch.distributed as dist

from hpcrl.algo.losses import PolicyLoss, gen_kl_error
from hpcrl.config.schema import RunConfig
from hpcrl.rollout.backends import sends_logprobs
from hpcrl.trainer.batch import TrainBatch
from hpcrl.trainer.packing import pack_rows

Metrics = dict[str, torch.Tensor | float]
"""One micro-batch's (or the step's) metrics: 0-dim tensors where they were computed, or floats."""


@dataclass
class StepBatch:
    """Rows of the step's batch with the log-probs the loss compares the policy's against."""

    data: TrainBatch
    old_logp: torch.Tensor | None
    """[b, T-1] under the policy that generated the rollouts; None: the current policy's (one
    optimizer step per batch, so the training forward's own log-probs, detached)."""
    ref_logp: torch.Tensor | None
    """[b, T-1] under the frozen reference policy; None: no KL term."""

    def __len__(self) -> int:
        return len(self.data)

    def select(self, idx: slice | torch.Tensor) -> StepBatch:
        return StepBatch(self.data.select(idx), *(None if t is None else t[idx] for t in self._logps()))

    def to(self, device: torch.device | str) -> StepBatch:
        return StepBatch(self.data.to(device), *(None if t is None else t.to(device) for t in self._logps()))

    def _logps(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.old_logp, self.ref_logp


LossFn = Callable[[int, StepBatch, torch.Tensor, torch.Tensor], tuple[torch.Tensor, Metrics]]
"""(micro-batch index, micro-batch, log-probs, entropy) -> (loss to differentiate, its metrics)."""


class StepBackend(Protocol):
    """What a training backend supplies to the step: its forward and its optimizer step."""

    data_group: dist.ProcessGroup | None
    """The data-parallel ranks, whose shards make up the batch (one of each model-parallel position):
    the step's metrics are reduced over them. None: this rank's shard is the whole batch."""

    def logprobs(self, batch: TrainBatch, reference: bool = False) -> torch.Tensor: ...

    def micro_batches(self, part: StepBatch, groups: list[torch.Tensor]) -> list[StepBatch]:
        """``part`` cut into micro-batch i = the rows ``groups[i]``, shaped as ``forward_backward``
        takes them. Unpacked, the groups are runs of ``micro_batch_size`` rows in order (the last may
        be shorter; a backend may pad it with rows whose loss mask is 0); packed, the bins of
        ``TrainStep.cut`` (a backend that packs: ``TrainerSpec.packs``)."""
        ...

    def zero_grad(self) -> None:
        """Drop the gradients (set to None: their memory goes back to the allocator)."""
        ...

    def forward_backward(self, micro_batches: list[StepBatch], loss_fn: LossFn) -> list[Metrics]:
        """Forward and backward over every micro-batch: for micro-batch i, ``loss_fn(i, mb, logp,
        entropy)`` (both [b, T-1] like ``mb``'s loss mask) gives the loss to differentiate and its
        metrics. Returns each micro-batch's metrics, in order, on every rank."""
        ...

    def optimizer_step(self) -> torch.Tensor | float:
        """Reduce and clip the gradients, step the optimizer; the gradient norm before clipping."""
        ...


def set_lr(param_groups: Iterable[dict[str, Any]], lr: float | None) -> None:
    """The step's learning rate on every parameter group (None: leave them)."""
    if lr is not None:
        for group in param_groups:
            group["lr"] = lr


@dataclass(frozen=True)
class TrainStep:
    """The step's settings: the objective and how the batch is cut."""

    loss: PolicyLoss
    minibatches: int
    micro_batch_size: int
    pack_tokens: int | None = None
    """``trainer.packing``'s token budget per micro-batch (None: micro-batches of rows)."""
    engine_logprobs: bool = True
    """The engines send each sampled token's log-prob (``rollout.logprobs``). Without them the batch's
    ``rollout_logp`` is a placeholder that nothing may read: no ``gen_kl_error`` (the config refuses an
    IS correction then), rather than a mismatch against zeros."""

    @classmethod
    def from_config(cls, cfg: RunConfig) -> TrainStep:
        loss = PolicyLoss.from_config(cfg.algo, cfg.rollout.max_new_tokens)
        logprobs = sends_logprobs(cfg.rollout)
        trainer = cfg.trainer
        budget = trainer.micro_tokens(cfg.max_seq_len) if trainer.packing else None
        return cls(loss, cfg.algo.num_minibatches, trainer.rows(), budget, logprobs)

    def even(
        self, groups: list[torch.Tensor], group: dist.ProcessGroup | None, device: torch.device | str
    ) -> int:
        """Filler micro-batches appended to ``groups`` (a copy of its first row, which callers give no
        weight) until every data-parallel rank has as many: packed bins differ in number between ranks,
        and each micro-batch's forward is collective (FSDP's gathers, the experts' all-to-all). How many
        were added; none unpacked (equal runs of rows on every rank)."""
        if self.pack_tokens is None or group is None:
            return 0
        count = torch.tensor([len(groups)], device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
        extra = int(count.item()) - len(groups)
        groups.extend(groups[0][:1].clone() for _ in range(extra))
        return extra

    def cut(self, lengths: torch.Tensor) -> list[torch.Tensor]:
        """Row indices of each micro-batch of a minibatch whose rows hold ``lengths`` real tokens:
        runs of ``micro_batch_size`` rows, or packed, first-fit-decreasing bins of the token budget."""
        if self.pack_tokens is None:
            return list(torch.arange(len(lengths)).split(self.micro_batch_size))
        return [torch.tensor(g) for g in pack_rows(lengths.tolist(), self.pack_tokens)]

    def __call__(
        self, backend: StepBackend, batch: TrainBatch, device: torch.device | str
    ) -> dict[str, float]:
        """One optimizer step per minibatch of ``batch`` (this rank's shard, the driver's CPU tensors);
        the metrics of the whole batch, the same on every data-parallel rank."""
        start = time.perf_counter()
        # the reference scores the rows on the rank that trains on them (the logprobs come back to the host)
        ref_logp = backend.logprobs(batch, reference=True) if self.loss.kl_coef > 0 else None
        totals = Totals()
        totals.add("time/ref_logprobs", time.perf_counter() - start, WHOLE)
        # The "old" policy is the one that generated the rollouts, as the trainer computes it. With a
        # single optimizer step per batch it equals the current policy, so its logprobs come free from
        # the training forward pass (logp.detach()) instead of a separate forward over the batch.
        old_logp = None if self.minibatches == 1 else backend.logprobs(batch)
        whole = StepBatch(batch, old_logp, ref_logp).to(device)
        # the loss tokens with the engine's log-prob (a sample: rollout.logprob_fraction), over the batch
        sent = batch.loss_mask * ~torch.isnan(batch.rollout_logp)
        sent_tokens = float(sent.sum())
        if whole.old_logp is not None and self.engine_logprobs:
            # the rollouts' mismatch with the old policy, over the whole batch
            d = whole.data
            totals.add(
                "gen_kl_error", gen_kl_error(whole.old_logp, d.rollout_logp, d.loss_mask), WHOLE, sent_tokens
            )
        lengths = batch.attention_mask.sum(dim=1)
        for part, rows in enumerate(torch.arange(len(batch)).chunk(self.minibatches)):
            # counts from the CPU tensors (no wait on the GPU), before a backend adds padding rows
            mask, groups = batch.loss_mask[rows], self.cut(lengths[rows])
            real = len(groups)
            fill = [0.0] * self.even(groups, backend.data_group, device)
            units, tokens = float(self.loss.units(mask)), float(mask.sum())
            shares = Shares(
                [float(self.loss.units(mask[g])) / max(units, 1.0) for g in groups[:real]] + fill,
                max(tokens, 1.0),
                [float(sent[rows][g].sum()) / max(sent_tokens, 1.0) for g in groups[:real]] + fill,
            )
            # what each metric is a mean over in this minibatch (its weight among the ranks): the loss's
            # units, but for these
            weights = {"entropy": tokens, "gen_kl_error": sent_tokens}
            backend.zero_grad()
            micro = backend.micro_batches(whole.select(rows), groups)
            assert len(micro) == len(groups), "micro_batches must give one micro-batch a group"
            for filler in micro[real:]:  # runs for the collectives only: no loss token, no weight
                filler.data.loss_mask.zero_()
            for metrics in backend.forward_backward(micro, partial(self.micro_loss, shares)):
                for key, value in metrics.items():
                    totals.add(key, value, part, weights.get(key, units))
            totals.add("grad_norm", backend.optimizer_step(), part)  # the same on every rank
        # Free the gradients now, not at the next step: between steps a colocated engine generates on
        # this GPU (4 bytes a parameter shard: 17 GB of an 8B shape on one GPU).
        backend.zero_grad()
        return totals.means(backend.data_group, device)

    def micro_loss(
        self, shares: Shares, i: int, mb: StepBatch, logp: torch.Tensor, entropy: torch.Tensor
    ) -> tuple[torch.Tensor, Metrics]:
        """Micro-batch ``i``'s loss, weighted by its share of the minibatch's loss units (tokens or
        sequences, ``PolicyLoss.units``) so that accumulation reproduces the full-minibatch value."""
        d, share = mb.data, shares.loss[i]
        old = logp.detach() if mb.old_logp is None else mb.old_logp
        terms = self.loss(logp, old, mb.ref_logp, d.rollout_logp, d.advantages, d.loss_mask)
        metrics: Metrics = {
            "loss": terms.loss.detach() * share,
            "policy_loss": terms.policy * share,
            "kl": terms.kl * share,
            "clip_fraction": terms.clip_fraction * share,
            "entropy": (entropy.detach() * d.loss_mask).sum() / shares.total_tokens,
        }
        # the old policy is this forward's (else: scored over the whole batch)
        if mb.old_logp is None and self.engine_logprobs:
            metrics["gen_kl_error"] = gen_kl_error(old, d.rollout_logp, d.loss_mask) * shares.sent[i]
        return terms.loss * share, metrics


@dataclass(frozen=True)
class Shares:
    """Each micro-batch's share of its minibatch's loss units (``PolicyLoss.units``), which weigh the
    loss and its metrics; the minibatch's loss tokens (the entropy's mean) and the micro-batch's share
    of the tokens ``gen_kl_error`` averages over."""

    loss: list[float]
    total_tokens: float
    """The minibatch's loss tokens (at least 1)."""
    sent: list[float]
    """Each micro-batch's loss tokens with the engine's log-prob, over the whole batch's (one
    minibatch: ``gen_kl_error`` is their token mean)."""


WHOLE = -1
"""The part of a metric taken over the whole batch rather than per minibatch (``Totals.add``)."""


class Totals:
    """Sums of the step's metrics, kept per part of the batch (a minibatch, or ``WHOLE``) with this
    rank's weight there: what the metric is a mean over in that part (loss units, loss tokens), or 1
    for a value every rank holds alike (the gradient norm). 0-dim tensors stay on their device until
    ``means``: a float() per metric would stall the CPU on the GPU before every backward and optimizer
    launch; floats (a backend that had to bring them to the host, as megatron's pipeline broadcast
    does) add as floats."""

    def __init__(self) -> None:
        self.sums: dict[tuple[str, int], torch.Tensor | float] = {}
        self.weights: dict[tuple[str, int], float] = {}

    def add(self, key: str, value: torch.Tensor | float, part: int = 0, weight: float = 1.0) -> None:
        at = (key, part)
        self.sums[at] = self.sums[at] + value if at in self.sums else value
        self.weights[at] = weight

    def means(
        self, group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu"
    ) -> dict[str, float]:
        """Each metric's mean over its parts, as floats: the step's one host sync. With ``group`` (the
        data-parallel ranks) each part is first combined over the ranks, sum(value x weight) /
        sum(weight): the mean over the whole batch's part, as one rank holding all of it computes it."""
        if not self.sums:
            return {}
        values = torch.stack([_float64(v, device) for v in self.sums.values()])
        if group is not None:
            weights = torch.tensor(list(self.weights.values()), dtype=torch.float64, device=device)
            both = torch.stack([values * weights, weights])
            dist.all_reduce(both, group=group)
            values = both[0] / both[1].clamp(min=1)  # weights are counts: none anywhere, the sum is 0
        per_key: dict[str, list[float]] = {}
        for (key, _), value in zip(self.sums, values.tolist(), strict=True):
            per_key.setdefault(key, []).append(value)
        return {key: sum(v) / len(v) for key, v in per_key.items()}


def _float64(value: torch.Tensor | float, device: torch.device | str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=device, dtype=torch.float64)
    return torch.tensor(value, dtype=torch.float64, device=device)
