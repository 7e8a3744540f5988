"""Gradients after Megatron's backward, before the optimizer steps: what Megatron's DDP and its
``clip_grad_norm`` would do, for a model trained without them.

``Gradients`` sorts the trainable parameters by how their gradients are reduced (dense over data x
context parallel, experts over expert data parallel, TP-partial norm weights over TP, the two
copies of the embedding (a tied head's, or the MTP layers' on the last stage) over the embedding
group), reduces them (``finalize``) and clips them by their
global norm over the model-parallel group (``clip``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hpcrl.core.parallel import TrainParallel
from hpcrl.trainer.megatron.weights import is_expert, is_sharded


class Gradients:
    def __init__(
        self,
        model: Any,
        par: TrainParallel,
        *,
        tied: bool,
        moe: bool,
        device: torch.device,
        mtp: bool = False,
    ) -> None:
        """``mtp``: the model carries MTP layers (megatron/mtp.py; under PP the last stage holds a copy
        of the input embedding for them)."""
        self.model, self.par, self.tied, self.moe, self.device = model, par, tied, moe, device
        self.mtp = mtp
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        # Experts differ per EP rank: their grads are reduced over the expert-DP group, not the DP one.
        self.expert_params = [p for n, p in named if is_expert(n)]
        self.dense_params = [p for n, p in named if not is_expert(n)]
        # Replicated over TP but computed from this rank's part: norms under sequence parallelism (a
        # slice of the sequence), Q/K norms always (this rank's heads). Megatron sums them over TP.
        self.tp_partial = [
            p
            for name, p in named
            if getattr(p, "sequence_parallel", False) or "q_layernorm" in name or "k_layernorm" in name
        ]

    def finalize(self) -> None:
        """What Megatron's DDP would do: sum over context parallel and average over data parallel, sum
        the TP-partial norm grads over TP, sum the two copies of the embedding (first and last stage)
        over their group."""
        from megatron.core import parallel_state as ps

        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        replicas = self.par.dp * self.par.cp
        if replicas > 1 and self.dense_params:
            # Megatron's schedule multiplies each loss by cp (its DDP averages over DP x CP), so the
            # average over both groups sums the CP ranks' token shares and averages over DP.
            group = ps.get_data_parallel_group(with_context_parallel=True)
            _all_reduce([p.grad for p in self.dense_params], group, scale=1 / replicas)
        if self.expert_params and (replicas > 1 or ps.get_expert_data_parallel_world_size() > 1):
            # An expert already got the gradients of every EP rank's tokens routed to it (the
            # all-to-all's backward: every data- and context-parallel rank's tokens when EP spans
            # them); the ranks holding the same experts (expert data parallel: DP, CP, and TP ranks
            # beyond EP, each with its own slice of the tokens under sequence parallel) saw different
            # tokens: sum over them, then scale as the dense gradients are (each CP rank's loss came
            # multiplied by cp, the average is over DP).
            grads = [p.grad for p in self.expert_params]
            _all_reduce(grads, ps.get_expert_data_parallel_group(), scale=1 / replicas)
        if self.par.tp > 1 and self.tp_partial:
            _all_reduce([p.grad for p in self.tp_partial], ps.get_tensor_model_parallel_group())
        copy = self._stage_copy()
        if copy is not None and copy.grad is not None:  # None: frozen (trainer.freeze), on both stages
            dist.all_reduce(copy.grad, group=ps.get_embedding_group())

    def _stage_copy(self) -> torch.Tensor | None:
        """This rank's copy of the weight the first and the last pipeline stage both hold: a tied
        embedding (the last stage's is the output layer's), or the input embedding the MTP layers read
        on the last stage. Summing their gradients keeps the copies equal, as Megatron does."""
        from megatron.core import parallel_state as ps

        if self.par.pp == 1 or not ps.is_rank_in_embedding_group():
            return None
        if self.tied:
            return self.model.shared_embedding_or_output_weight()
        return self.model.embedding.word_embeddings.weight if self.mtp else None

    def clip(self, max_norm: float) -> float:
        """Global L2 norm over the model-parallel group, TP-replicated weights and the embedding's
        last-stage copy (``shared``) counted once; every gradient scaled down to ``max_norm`` if above.
        Returns the norm before clipping."""
        from megatron.core import parallel_state as ps

        tp_rank = ps.get_tensor_model_parallel_rank()
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        expert_sq = torch.zeros((), dtype=torch.float32, device=self.device)
        for name, p in self.model.named_parameters():
            if p.grad is None or getattr(p, "shared", False):
                continue  # frozen, or the last stage's copy of a tied embedding
            # pow(2).sum(), not norm(): torch's fp32 norm on CPU drifts on big tensors (Gemma 3's
            # 16M-element fc1: 1.05155 against 1.05329 in float64; pow(2).sum() gives 1.05329)
            if is_expert(name):
                expert_sq += p.grad.float().pow(2).sum()
            elif is_sharded(name) or tp_rank == 0:
                sq += p.grad.float().pow(2).sum()
        dist.all_reduce(sq, group=ps.get_model_parallel_group())
        if self.moe:  # each EP rank (and pipeline stage) holds different experts
            dist.all_reduce(expert_sq, group=ps.get_expert_tensor_model_pipeline_parallel_group())
        norm = float((sq + expert_sq).sqrt())
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for p in self.params:
                p.grad.mul_(coef)
        return norm


def _all_reduce(tensors: list[torch.Tensor], group: Any, scale: float = 1.0) -> None:
    """Sum ``tensors`` over ``group`` (then scale) in one collective per dtype, not one per tensor."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = _flatten_dense_tensors(same)
        dist.all_reduce(flat, group=group)
        if scale != 1.0:
            flat.mul_(scale)
        for t, reduced in zip(same, _unflatten_dense_tensors(flat, same), strict=True):
            t.copy_(reduced)
