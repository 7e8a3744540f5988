"""Log-probabilities of the next token without materialising the logits.

A GRPO step needs ``log p(target)`` and the entropy at every position, never the logits themselves.
Through ``lm_head`` + log-softmax, a Qwen2-1.5B batch of 8 x 2048 tokens holds 5 GB of bf16 logits,
10 GB of fp32 copies for the log-softmax and as much again for their gradient. ``ChunkedLogprob`` walks
the tokens in chunks: each chunk's logits live only inside the chunk loop (fp32, one chunk at a time),
and the backward pass recomputes them (one extra ``lm_head`` matmul, ~4% of the step's FLOPs) instead
of keeping them. The numbers are the same as the plain path's (fp32 log-softmax of the compute-dtype
logits); ``tests/trainer/test_trainer.py`` checks values and gradients against it.

``LogprobHead`` puts it where ``lm_head`` was, so the model's own forward (and FSDP's hooks around
it) produce ``[B, T, 2]`` = (log p of the next token, entropy) instead of ``[B, T, vocab]`` logits.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from hpcrl.trainer.config import CHUNK_ELEMENTS, FUSED_CHUNK_ELEMENTS  # torch-free there, for the planner


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma's logit soft-capping, cap * tanh(x / cap) (None: the logits as they are)."""
    return x if cap is None else cap * torch.tanh(x / cap)


def chunk_stats(
    logits: torch.Tensor, targets: torch.Tensor, cap: float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log p(target), entropy, logsumexp) of one chunk of logits (soft-capped at ``cap``), in fp32
    (fp64 stays fp64)."""
    x = soft_cap(logits.to(torch.promote_types(logits.dtype, torch.float32)), cap)
    lse = torch.logsumexp(x, dim=-1)
    target = x.gather(-1, targets[:, None]).squeeze(-1)
    entropy = lse - (torch.exp(x - lse[:, None]) * x).sum(-1)
    return target - lse, entropy, lse


def chunk_grad(
    logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, cap: float | None = None
) -> torch.Tensor:
    """d(sum g * log p(target)) / d logits = g * (onehot(target) - softmax(capped)), times the cap's
    derivative 1 - tanh(logits / cap)^2 when soft-capped; in the logits' dtype."""
    x = logits.to(lse.dtype)
    slope = None
    if cap is not None:
        t = torch.tanh(x / cap)
        x, slope = cap * t, 1 - t * t
    onehot = torch.arange(x.shape[-1], device=x.device)[None, :] == targets[:, None]
    grad = g[:, None] * (onehot.to(x.dtype) - torch.exp(x - lse[:, None]))
    return (grad if slope is None else grad * slope).to(logits.dtype)


_compiled: dict[str, Any] = {}


def chunk_fns(device: torch.device) -> tuple[Any, Any, int]:
    """The chunk math and chunk size for ``device``: compiled on GPUs (dynamic shapes: the last,
    shorter chunk and every new batch width reuse the same kernels), eager elsewhere."""
    if device.type != "cuda":
        return chunk_stats, chunk_grad, CHUNK_ELEMENTS
    if not _compiled:
        _compiled["stats"] = torch.compile(chunk_stats, dynamic=True)
        _compiled["grad"] = torch.compile(chunk_grad, dynamic=True)
    return _compiled["stats"], _compiled["grad"], FUSED_CHUNK_ELEMENTS


class ChunkedLogprob(torch.autograd.Function):
    """(hidden [N, h], weight [V, h], targets [N]) -> (log p(target) [N], entropy [N]), both fp32
    (fp64 for fp64 inputs), the logits soft-capped at ``cap`` when given. Gradients flow to ``hidden``
    and ``weight`` through log p only (the entropy is a metric)."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        rows: int | None,
        cap: float | None = None,
    ) -> Any:
        stats, _, elements = chunk_fns(hidden.device)
        rows = rows or max(1, elements // weight.shape[0])
        parts = [
            stats(hidden[s : s + rows] @ weight.t(), targets[s : s + rows], cap)
            for s in range(0, hidden.shape[0], rows)
        ]
        logp, entropy, lse = (torch.cat(p) for p in zip(*parts, strict=True))
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.rows, ctx.cap = rows, cap
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, grad_logp: torch.Tensor, _grad_entropy: Any) -> Any:
        hidden, weight, targets, lse = ctx.saved_tensors
        rows = ctx.rows
        _, grad_fn, _ = chunk_fns(hidden.device)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # accumulated over the chunks in fp32 (fp64 for fp64 weights), cast once at the end
        acc = torch.promote_types(weight.dtype, torch.float32)
        grad_weight = (
            torch.zeros(weight.shape, dtype=acc, device=weight.device) if ctx.needs_input_grad[1] else None
        )
        for s in range(0, hidden.shape[0], rows):
            h = hidden[s : s + rows]
            grad_logits = grad_fn(
                h @ weight.t(),
                targets[s : s + rows],
                lse[s : s + rows],
                grad_logp[s : s + rows].to(lse.dtype),
                ctx.cap,
            )
            if grad_hidden is not None:
                grad_hidden[s : s + rows] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight.add_(grad_logits.t() @ h)
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None


def chunked_logprob(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    rows: int | None = None,
    cap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) and entropy for hidden states of any leading shape ``[..., h]``; ``cap``: the
    logits soft-capped first (Gemma's ``final_logit_softcapping``)."""
    lead = hidden.shape[:-1]
    logp, entropy = ChunkedLogprob.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1), rows, cap
    )
    return logp.view(lead), entropy.view(lead)


class LogprobHead(nn.Module):
    """Takes ``lm_head``'s place (and its weight: a tied embedding stays tied). While ``targets``
    are set it returns ``[..., 2]`` = (log p(target), entropy); it is only ever called that way."""

    def __init__(self, lm_head: nn.Linear, cap: float | None = None) -> None:
        super().__init__()
        self.weight = lm_head.weight
        self.in_features, self.out_features = lm_head.in_features, lm_head.out_features
        self.cap = cap  # the model's logit soft cap (Gemma), applied here instead of after the head
        self._targets: torch.Tensor | None = None

    @contextmanager
    def targets(self, targets: torch.Tensor) -> Iterator[None]:
        self._targets = targets
        try:
            yield
        finally:
            self._targets = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._targets is None:
            raise RuntimeError("LogprobHead needs targets: call the model inside `with head.targets(ids):`")
        logp, entropy = chunked_logprob(hidden, self.weight, self._targets, cap=self.cap)
        return torch.stack([logp, entropy], dim=-1)


def install_logprob_head(model: nn.Module) -> LogprobHead | None:
    """Replace a causal LM's plain ``lm_head`` (a bias-free Linear applied last, as in Qwen2/Qwen3/Llama/
    Gemma) by a ``LogprobHead``. Gemma's logit soft cap moves into the head: the model's config stops
    naming it, else the model's forward would cap the head's (log p, entropy) output — a
    vision-language model keeps it on its text config (Gemma 4), so both are read. Models that scale
    the logits after the head, or have no such head, keep theirs; None then, and the caller takes the
    logits path."""
    head = getattr(model, "lm_head", None)
    config = getattr(model, "config", None)
    if type(head) is not nn.Linear or head.bias is not None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    configs = [c for c in (config, text) if c is not None]
    if any(getattr(c, "logit_scale", None) for c in configs):
        return None
    capped = [c for c in configs if getattr(c, "final_logit_softcapping", None)]
    new = LogprobHead(head, cap=float(capped[0].final_logit_softcapping) if capped else None)
    for c in capped:
        c.final_logit_softcapping = None
    model.lm_head = new
    return new
