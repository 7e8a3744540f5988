"""The fsdp backend's forward: per-token log-probs and entropy from a Hugging Face causal LM, over
whole sequences or (``trainer.cp`` > 1) this rank's part of each (trainer/context_parallel.py)."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from hpcrl.trainer.batch import TrainBatch
from hpcrl.trainer.context_parallel import CPGroup
from hpcrl.trainer.logprob_head import LogprobHead
from hpcrl.trainer.packing import Packed
from hpcrl.trainer.router_replay import set_routes
from hpcrl.trainer.ssd import seq_index
from hpcrl.trainer.varlen import packed_attention, use_packed_attention


def token_logprobs(
    model: Any, batch: TrainBatch, right_padded: bool | None = None, cp: CPGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability and entropy of every target token: [B, T-1] each. ``right_padded``: known
    already (saves a check that waits on the GPU); None checks. ``cp``: split each sequence over
    this context-parallel group (right-padded batches only); the result is whole on every rank."""
    # use_cache=False: HF would otherwise build a KV cache in every training forward (a copy of each
    # layer's keys and values, and a per-layer guard that made torch.compile recompile every layer).
    # Right padding sits after every real token, so under causal attention no real token sees it:
    # the padding mask changes nothing that counts and, left out, lets SDPA take its flash kernel
    # (with a mask it falls back to the memory-efficient kernel and repeats the GQA heads).
    if right_padded is None:
        right_padded = is_right_padded(batch.attention_mask)
    ids = batch.input_ids
    set_routes(model, batch.routes)
    targets = torch.nn.functional.pad(ids[:, 1:], (0, 1))  # the last position predicts nothing
    if cp is not None and cp.size > 1:
        if batch.routes is not None:
            raise ValueError("trainer.router_replay does not split routes over trainer.cp ranks yet")
        if not right_padded:
            raise ValueError("trainer.cp > 1 trains on right-padded batches only (what build_batch makes)")
        return _split_logprobs(model, ids, targets, cp)
    mask = None if right_padded else batch.attention_mask
    skip = batch.loss_from if takes_logits_to_keep(model) else 0
    inputs = {"input_ids": ids, "attention_mask": mask, **batch.image_inputs()}
    if skip <= 0:
        logp, entropy = _logprobs(model, targets, **inputs)
        return logp[:, :-1], entropy[:, :-1]
    # the head only where a loss target can be: the last T - skip positions; zeros before them
    logp, entropy = _logprobs(model, targets[:, skip:], **inputs, logits_to_keep=ids.shape[1] - skip)
    return _left_pad(logp, skip)[:, :-1], _left_pad(entropy, skip)[:, :-1]


def packed_logprobs(
    model: Any, batch: TrainBatch, recurrent: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``token_logprobs`` of right-padded rows run as one packed row (``trainer.packing``): the rows'
    real tokens one after another, positions restarting at each, attention inside each sequence without
    an [L, L] mask (``trainer/varlen.py``; a model not on SDPA gets transformers' mask from the restarts);
    [B, T-1] each, at the loss targets (zeros elsewhere, where no reader looks). ``recurrent`` (Mamba layers): each token's
    sequence goes along as ``seq_idx``, where their conv and scan restart (``fsdp/segments.py``)."""
    packed = Packed.of(batch.input_ids, batch.attention_mask)
    set_routes(model, None if batch.routes is None else packed.gather(batch.routes))
    inputs = {"input_ids": packed.ids, "position_ids": packed.positions}
    if recurrent:
        inputs["seq_idx"] = seq_index(packed.positions)
    width = batch.input_ids.shape[1] - 1
    use_packed_attention(model)
    with packed_attention(packed.positions):
        if not takes_logits_to_keep(model):
            logp, entropy = _logprobs(model, packed.targets, **inputs)
            return packed.unpack(logp, width), packed.unpack(entropy, width)
        # the head only where a loss target is (every reader of these values masks by the loss mask): at
        # 185 prompt tokens and ~20 generated, a head over every packed token would be 90% wasted
        keep = packed.index_of(batch.loss_mask)
        logp, entropy = _logprobs(model, packed.targets[:, keep], **inputs, logits_to_keep=keep)
    return packed.unpack_kept(logp, keep, width), packed.unpack_kept(entropy, keep, width)


def _left_pad(values: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(values, (width, 0))


_KEEPS: dict[type, bool] = {}


def takes_logits_to_keep(model: Any) -> bool:
    """Whether the model's forward computes its head on the last ``logits_to_keep`` positions only
    (transformers' causal LMs do)."""
    kind = type(model)
    if kind not in _KEEPS:
        _KEEPS[kind] = "logits_to_keep" in inspect.signature(model.forward).parameters
    return _KEEPS[kind]


def _split_logprobs(
    model: Any, ids: torch.Tensor, targets: torch.Tensor, cp: CPGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's positions through the model (true positions to RoPE, the layout to attention),
    the log-probs and entropy gathered back to whole rows."""
    width = ids.shape[1]
    layout = cp.layout(width, ids.device)
    positions = layout.local[None].expand(ids.shape[0], -1)
    logp, entropy = _logprobs(
        model, layout.shard(targets), input_ids=layout.shard(ids), position_ids=positions, hpcrl_cp=layout
    )
    return layout.unshard(logp, width - 1), layout.unshard(entropy.detach(), width - 1)


def _logprobs(model: Any, targets: torch.Tensor, **inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's log p(``targets``) and entropy at every input position: through the chunked head
    where installed, else from the logits."""
    head = getattr(model, "lm_head", None)
    if isinstance(head, LogprobHead):
        with head.targets(targets):
            out = model(**inputs, use_cache=False).logits
        return out[..., 0], out[..., 1]
    return logprob_and_entropy(model(**inputs, use_cache=False).logits, targets)


def is_right_padded(mask: torch.Tensor) -> bool:
    """Every row is ones then zeros (what ``build_batch`` makes)."""
    return bool((mask[:, 1:] <= mask[:, :-1]).all())


def logprob_and_entropy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) = logit - logsumexp(logits), in fp32, without materialising a full log-softmax
    (which at 8 x 2048 x 152k vocab is 10 GB, plus as much again for its gradient)."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets[..., None]).squeeze(-1) - lse
    with torch.no_grad():  # a metric only: keep it out of the autograd graph
        entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logp, entropy
