"""The megatron backend's forward: micro-batches shaped for Megatron's pipeline schedules, the
schedule run over them, and per-token log-probs and entropy from what the last stage outputs.

Shapes: the schedules pass one tensor shape, so a short last micro-batch is padded with zero-weight
rows, and the width is a multiple of TP (sequence parallel splits it) and of 2·CP (context
parallel's chunks). Log-probs: from the final hidden states in chunks at TP=1 (the chunked head),
else vocab-parallel across TP. Context parallel: each CP rank feeds its two chunks of every sequence
(``cp_split``) and gathers the per-token log-probs back into whole sequences (``cp_join``; the
gradient returns to the rank that computed each token), so the loss is the same on every CP rank and
its parameter gradients cover that rank's tokens: their sum over CP is the whole sequence's. Results
come from the last pipeline stage and are broadcast to the whole pipeline.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from hpcrl.core.parallel import TrainParallel
from hpcrl.trainer.batch import TrainBatch
from hpcrl.trainer.logprob_head import chunked_logprob, soft_cap
from hpcrl.trainer.megatron.attention import cp_gather
from hpcrl.trainer.megatron.router_replay import RouteReplay, local_routes
from hpcrl.trainer.packing import Packed
from hpcrl.trainer.step import StepBatch
from hpcrl.trainer.varlen import RowBounds

ScheduleLoss = Callable[[int, StepBatch, torch.Tensor], tuple[torch.Tensor, dict[str, Any]]]
"""(micro-batch index, micro-batch, last stage's output) -> (loss for the schedule, its metrics)."""


@dataclass(frozen=True)
class Pipeline:
    par: TrainParallel
    device: torch.device
    chunked_head: bool
    """Log-probs from the final hidden states in chunks (TP=1), not from vocab-parallel logits."""
    tied: bool
    compute_dtype: torch.dtype
    softcap: float | None
    """The family's final logit soft cap (Gemma)."""
    pack_width: int | None = None
    """``trainer.packing``: each micro-batch's rows run as one packed row of this many tokens (the
    budget, rounded up to a multiple of TP and of 2·CP: context parallel splits the row as it splits a
    sequence); None: rows as they are."""
    replay: RouteReplay | None = None
    """``trainer.router_replay``: where each forward's routes go (``megatron/router_replay.py``).

    Packed rows pass their sequences' bounds (``packed_seq_params``), no mask: attention stays inside
    each sequence by them (sliding windows and context parallel included), Mamba layers restart their
    conv and scan at each."""

    def micro_batches(self, batch: TrainBatch, size: int) -> list[TrainBatch]:
        """Equal micro-batches of ``size`` rows (fewer for a smaller batch), width a multiple of TP and
        of 2·CP; the padding rows are copies of the first row with a zero loss mask."""
        size = min(size, len(batch))
        extra = (-len(batch)) % size
        if extra:
            pad = batch.select(torch.zeros(extra, dtype=torch.long))
            pad.loss_mask.zero_()
            batch = _concat([batch, pad])
        width = batch.input_ids.shape[1]
        grow = (-width) % (self.par.tp * (2 * self.par.cp if self.par.cp > 1 else 1))
        if grow:
            batch = _widen(batch, width + grow)
        return [batch.select(slice(i, i + size)) for i in range(0, len(batch), size)]

    def run(self, model: Any, mbs: list[StepBatch], loss: ScheduleLoss, forward_only: bool) -> list[Any]:
        """Megatron's forward(/backward) schedule over ``mbs``: what ``loss`` returned as metrics, per
        micro-batch, on the last pipeline stage (nothing elsewhere)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
            i, mb = next(data_iterator)
            ids, routes = mb.data.input_ids.to(self.device), mb.data.routes
            pos = torch.arange(ids.shape[1], device=self.device).expand_as(ids)
            bounds = {}
            if self.pack_width is not None:  # positions restart per sequence (GPTModel's RoPE reads the
                packed = self.packed(mb.data)  # length only: relative, so an offset changes no score)
                ids, pos, bounds = packed.ids, packed.positions, {"packed_seq_params": seq_params(packed)}
                routes = None if routes is None else packed.gather(routes.to(self.device))
            if self.replay is not None:
                self.replay.routes = (
                    None if routes is None else local_routes(routes, self.par.tp, self.cp_split)
                )
            out = model(
                input_ids=self.cp_split(ids), position_ids=self.cp_split(pos), attention_mask=None, **bounds
            )
            return out, partial(loss, i, mb)

        packed = self.pack_width is not None
        return list(
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(enumerate(mbs)),
                model=[model],
                num_microbatches=len(mbs),
                seq_length=self.pack_width if packed else mbs[0].data.input_ids.shape[1],
                micro_batch_size=1 if packed else len(mbs[0]),
                forward_only=forward_only,
            )
        )

    def packed(self, batch: TrainBatch) -> Packed:
        """``batch``'s rows as one packed row of ``pack_width`` tokens, on this device."""
        assert self.pack_width is not None
        ids, mask = batch.input_ids.to(self.device), batch.attention_mask.to(self.device)
        return Packed.of(ids, mask).padded(self.pack_width)

    def token_stats(
        self, model: Any, out: torch.Tensor, batch: TrainBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """log p(target) and entropy per token, [b, s] on every CP rank: from the final hidden states
        [b, s, h] in chunks (``chunked_head``), else vocab-parallel from this rank's [b, s, vocab/tp]
        logits. Packed micro-batches: [rows, s - 1], each row's targets as the unpacked forward's."""
        if self.pack_width is not None:  # at the loss targets only (what every reader looks at), unpacked
            packed, width = self.packed(batch), batch.input_ids.shape[1]
            keep = packed.index_of(batch.loss_mask)
            if self.par.cp > 1:  # this rank holds its chunks of the row: all its positions, joined
                whole = self._token_stats(model, out, self.cp_split(packed.targets))
                logp, entropy = (t[:, keep] for t in whole)
            else:
                logp, entropy = self._token_stats(model, out[:, keep], packed.targets[:, keep])
            return packed.unpack_kept(logp, keep, width - 1), packed.unpack_kept(entropy, keep, width - 1)
        ids = batch.input_ids.to(self.device)
        # the last position predicts nothing we use
        return self._token_stats(model, out, self.cp_split(torch.nn.functional.pad(ids[:, 1:], (0, 1))))

    def _token_stats(
        self, model: Any, out: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        if self.chunked_head:
            weight = model.shared_embedding_or_output_weight() if self.tied else model.output_layer.weight
            # the loss runs outside the schedule's autocast: cast as autocast would have
            logp, entropy = chunked_logprob(
                out.to(self.compute_dtype), weight.to(self.compute_dtype), targets, cap=self.softcap
            )
            return self.cp_join(logp), self.cp_join(entropy)
        logits = soft_cap(out.float(), self.softcap)  # as HF caps them, before log-softmax
        group = ps.get_tensor_model_parallel_group()
        with torch.no_grad():  # entropy is a metric: all-reduced pieces of logsumexp and E[logit]
            m = logits.max(-1).values
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            e = torch.exp(logits - m[..., None])
            z, s = e.sum(-1), (e * logits).sum(-1)
            dist.all_reduce(z, group=group)
            dist.all_reduce(s, group=group)
            entropy = torch.log(z) + m - s / z
        logp = -vocab_parallel_cross_entropy(logits, targets)
        return self.cp_join(logp), self.cp_join(entropy)

    def cp_split(self, t: torch.Tensor) -> torch.Tensor:
        """This context-parallel rank's part of [b, s]: chunks r and 2·cp-1-r of 2·cp (Megatron's layout)."""
        from megatron.core import parallel_state as ps

        cp = self.par.cp
        if cp == 1:
            return t
        rank = ps.get_context_parallel_rank()
        chunks = t.chunk(2 * cp, dim=1)
        return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=1)

    def cp_join(self, t: torch.Tensor) -> torch.Tensor:
        """[b, s/cp] per CP rank -> the whole [b, s] on every CP rank (inverse of ``cp_split``); the
        backward keeps only this rank's part of the gradient (each rank holds the same loss)."""
        from megatron.core import parallel_state as ps

        if self.par.cp == 1:
            return t
        return cp_gather(t.t(), ps.get_context_parallel_group(), sum_grads=False).t()

    def from_last_stage(self, obj: Any) -> Any:
        """``obj`` as the last pipeline stage holds it, on every stage."""
        from megatron.core import parallel_state as ps

        if self.par.pp == 1:
            return obj
        box = [obj]
        src = ps.get_pipeline_model_parallel_last_rank()
        dist.broadcast_object_list(box, src=src, group=ps.get_pipeline_model_parallel_group())
        return box[0]


def as_floats(outs: list[dict[str, torch.Tensor]]) -> list[dict[str, float]]:
    """The schedule's per-micro-batch metric tensors as floats, in one host sync."""
    if not outs:
        return []  # not the last pipeline stage
    keys = list(outs[0])
    values = torch.stack([torch.stack([o[k].float() for k in keys]) for o in outs]).tolist()
    return [dict(zip(keys, row, strict=True)) for row in values]


def fit(t: torch.Tensor | None, rows: slice, like: torch.Tensor) -> torch.Tensor | None:
    """``t[rows]`` in a zero tensor shaped like ``like`` (the rows of a padded micro-batch; its
    padding rows and columns zero)."""
    if t is None:
        return None
    out = torch.zeros(like.shape, dtype=t.dtype, device=like.device)
    part = t[rows]
    out[: len(part), : min(part.shape[1], out.shape[1])] = part[:, : out.shape[1]]
    return out


def seq_params(packed: Packed) -> Any:
    """Megatron's ``PackedSeqParams`` of a packed row: where each sequence starts and the real
    tokens end (what Megatron's MambaMixer reads; the padding past them is one more sequence there,
    attention skips it), the row's width as the longest (GPTModel sizes RoPE by it: the row's
    positions, as unpacked), and the same bounds with their host lengths (``hpcrl_row``, attention's)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    row = RowBounds.of(packed.lengths, packed.ids.device)
    width = packed.ids.shape[1]
    params = PackedSeqParams("sbhd", row.cu, row.cu, max_seqlen_q=width, max_seqlen_kv=width)
    params.hpcrl_row = row  # a field Megatron's dataclass lacks: the lengths without a device sync
    return params


def _concat(parts: list[TrainBatch]) -> TrainBatch:
    cat: dict[str, Any] = {
        f: torch.cat([getattr(p, f) for p in parts])
        for f in ("input_ids", "attention_mask", "loss_mask", "advantages", "rollout_logp")
    }
    routes = None if parts[0].routes is None else torch.cat([p.routes for p in parts if p.routes is not None])
    return TrainBatch(**cat, loss_from=min(p.loss_from for p in parts), routes=routes)


def _widen(batch: TrainBatch, width: int) -> TrainBatch:
    grow = width - batch.input_ids.shape[1]
    pad = torch.nn.functional.pad
    return TrainBatch(
        pad(batch.input_ids, (0, grow)),
        pad(batch.attention_mask, (0, grow)),
        pad(batch.loss_mask, (0, grow)),
        batch.advantages,
        pad(batch.rollout_logp, (0, grow)),
        batch.loss_from,
        routes=None if batch.routes is None else pad(batch.routes, (0, 0, 0, 0, 0, grow), value=-1),
    )
