"""The training batch handed to a trainer backend: token ids plus per-token masks and weights."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class TrainBatch:
    input_ids: torch.Tensor
    """[B, T] prompt + completion, right-padded."""
    attention_mask: torch.Tensor
    """[B, T] 1 on real tokens."""
    loss_mask: torch.Tensor
    """[B, T-1] 1 where the target token (input_ids[:, 1:]) is a generated token that counts in the loss."""
    advantages: torch.Tensor
    """[B] one advantage per sequence."""
    rollout_logp: torch.Tensor
    """[B, T-1] the rollout engine's logprob of each generated target token (0 elsewhere; NaN over
    completions the engine sent none for: ``rollout.logprob_fraction``, ``rollout.logprobs=false``)."""
    loss_from: int = 0
    """No row has a loss target before this position (``build_batch``: the shortest prompt - 1), so
    the trainer runs the LM head from here on only: at 185 prompt tokens and ~20 generated, the head
    and its log-softmax over the vocabulary would otherwise be 90% wasted (TRL's ``logits_to_keep``)."""
    images: list[dict[str, torch.Tensor]] | None = None
    """Per row, the model processor's tensors of its prompt's images (pixel values and what the model
    reads beside them: ``run/vision.py``), each with a leading dimension of 1; None: text only."""
    routes: torch.Tensor | None = None
    """[B, T, layers, k] int16: the experts the rollout engine's routers chose at each input position
    (``trainer.router_replay``), -1 where the trainer's routers choose (padding, each row's last
    token, a sample without routes); None: no replay."""

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device | str) -> TrainBatch:
        return dataclasses.replace(
            self,
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            loss_mask=self.loss_mask.to(device),
            advantages=self.advantages.to(device),
            rollout_logp=self.rollout_logp.to(device),
            routes=None if self.routes is None else self.routes.to(device),
        )

    def select(self, idx: slice | torch.Tensor) -> TrainBatch:
        return TrainBatch(
            self.input_ids[idx],
            self.attention_mask[idx],
            self.loss_mask[idx],
            self.advantages[idx],
            self.rollout_logp[idx],
            self.loss_from,
            None if self.images is None else _rows(self.images, idx),
            None if self.routes is None else self.routes[idx],
        )

    def image_inputs(self) -> dict[str, torch.Tensor]:
        """The rows' image tensors as one forward's keyword arguments, on the batch's device: stacked
        along the rows; token-aligned ones (``*token_type_ids``: which prompt tokens are an image's,
        Gemma's bidirectional image attention) right-padded to the batch's width as the ids are."""
        if not self.images:
            return {}
        width, out = self.input_ids.shape[1], {}
        for key in self.images[0]:
            parts = [row[key] for row in self.images]
            if key.endswith("token_type_ids"):
                parts = [torch.nn.functional.pad(p, (0, width - p.shape[-1])) for p in parts]
            out[key] = torch.cat(parts).to(self.input_ids.device)
        return out


def _rows(rows: list[dict[str, torch.Tensor]], idx: slice | torch.Tensor) -> list[dict[str, torch.Tensor]]:
    if isinstance(idx, slice):
        return rows[idx]
    picked = idx.nonzero().flatten() if idx.dtype == torch.bool else idx.flatten()
    return [rows[int(i)] for i in picked]


def build_batch(
    prompts: list[list[int]],
    completions: list[list[int]],
    rollout_logps: list[list[float]],
    advantages: list[float],
    keep: list[float],
    pad_id: int,
    images: list[dict[str, torch.Tensor] | None] | None = None,
    routes: list[Any] | None = None,
    masks: list[list[int] | None] | None = None,
) -> TrainBatch:
    """Right-padded batch; ``keep`` (0/1 per sample) zeroes the loss mask of filtered samples. A sample
    without rollout logprobs (an empty list: the engine was not asked, ``rollout.logprob_fraction``)
    gets NaN there, which the IS correction and ``gen_kl_error`` leave out. ``images``: each row's
    image tensors (``TrainBatch.images``; None for a text-only row). ``routes``: each sample's
    ``Completion.routes`` (or None), for ``trainer.router_replay``. ``masks``: each sample's
    ``Completion.mask`` (1 on the model's tokens, 0 on a multi-turn environment's; None: all the
    model's), multiplied into the loss mask."""
    rows = [p + c for p, c in zip(prompts, completions, strict=True)]
    width = max(len(r) for r in rows)
    n = len(rows)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    loss_mask = torch.zeros((n, width - 1), dtype=torch.float32)
    rlp = torch.zeros((n, width - 1), dtype=torch.float32)
    for i, (p, c, lp) in enumerate(zip(prompts, completions, rollout_logps, strict=True)):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        attn[i, : len(p) + len(c)] = 1
        # target position j predicts ids[j+1]: completion tokens sit at targets len(p)-1 ... len(p)+len(c)-2
        loss_mask[i, len(p) - 1 : len(p) - 1 + len(c)] = keep[i] * _model_tokens(masks, i, len(c))
        if lp and len(lp) != len(c):
            raise ValueError(f"sample {i}: {len(lp)} rollout logprobs for {len(c)} completion tokens")
        rlp[i, len(p) - 1 : len(p) - 1 + len(c)] = torch.tensor(lp, dtype=torch.float32) if lp else math.nan
    loss_from = max(0, min(len(p) for p in prompts) - 1)
    adv = torch.tensor(advantages, dtype=torch.float32)
    routed = _routes(routes, rows, width)
    return TrainBatch(ids, attn, loss_mask, adv, rlp, loss_from, _image_rows(images or [], n), routed)


def _model_tokens(masks: list[list[int] | None] | None, i: int, length: int) -> torch.Tensor:
    """Sample ``i``'s per-token mask of the model's tokens (all ones when it has none)."""
    mask = masks[i] if masks else None
    if mask is None:
        return torch.ones(length)
    if len(mask) != length:
        raise ValueError(f"sample {i}: a token mask of {len(mask)} for {length} completion tokens")
    return torch.tensor(mask, dtype=torch.float32)


def _image_rows(images: list[dict[str, torch.Tensor] | None], n: int) -> list[dict[str, torch.Tensor]] | None:
    """Every row's image tensors, or None where no row has any. One forward takes the rows' pixels
    together, so a batch is all image rows or all text rows."""
    rows = [i for i in images if i is not None]
    if rows and len(rows) != n:
        raise ValueError(f"{len(rows)} of {n} rows carry images: a batch is all image rows or all text rows")
    return rows or None


def _routes(routes: list[Any] | None, rows: list[list[int]], width: int) -> torch.Tensor | None:
    """[B, width, layers, k]: each sample's routes from position 0 on (a route per position but the
    last), -1 elsewhere; None when no sample has routes."""
    given = [torch.as_tensor(r) for r in routes or [] if r is not None]
    if not given:
        return None
    assert routes is not None
    out = torch.full((len(rows), width, *given[0].shape[1:]), -1, dtype=torch.int16)
    for i, (r, row) in enumerate(zip(routes, rows, strict=True)):
        if r is None:
            continue
        if len(r) != len(row) - 1:
            raise ValueError(
                f"sample {i}: routes for {len(r)} positions, its {len(row)} tokens need {len(row) - 1}"
            )
        out[i, : len(r)] = torch.as_tensor(r)
    return out
