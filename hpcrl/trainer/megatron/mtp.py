"""A hybrid model's multi-token-prediction (MTP) layers in the megatron backend
(``trainer.mtp_loss_scale``; the fsdp backend's are trainer/mtp.py's, with the same math).

``MTPBlock`` is the model's ``mtp_block`` submodule (megatron-core's schedules take a model's
``mtp`` for its own MultiTokenPredictionBlock): ``mtp_block.layers.<i>`` for ``i`` over the depths times the
block's pattern (``mtp_layers_block_type``), each a layer of the decoder's own kind built from the
same specs (families' ``stack_layers``: Mamba, attention, MoE, MLP), numbered after the decoder's; a
depth's first layer also holds ``enorm``, ``hnorm`` and ``eh_proj`` [h, 2h], its last
``final_layernorm``. Named so, the checkpoint's ``mtp.layers.<i>.*`` load, export and refit through
weights_hybrid.py by the same rules as the decoder's layers.

The loss runs beside the policy loss on the last stage's output: at TP=1 the model returns its final
hidden states (model.HiddenOutput), which are depth 0's input; the token embedding and the output
head are the model's. Built at TP = PP = CP = 1 without packing (the plan refuses the rest:
plan/mtp.py).

Imports Megatron-core: imported only where a Megatron model is built.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from megatron.core.transformer.module import MegatronModule

from hpcrl.trainer import mtp as shared
from hpcrl.trainer.megatron.norms import SPNorm
from hpcrl.trainer.megatron.spec_utils import build

SLOT = {"M": "mamba_layer", "*": "attention_layer", "-": "mlp_layer", "E": "moe_layer"}


class MTPBlock(MegatronModule):
    def __init__(self, config: Any, layers: dict[str, Any], kinds: str, depths: int, groups: Any) -> None:
        """``kinds``: one symbol a layer over every depth (``Shape.mtp``); ``groups``: the model's
        process groups (its ``pg_collection``)."""
        super().__init__(config)
        self.depths, self.width = depths, len(kinds) // depths
        first = config.num_layers  # numbered after the decoder's layers, as vLLM numbers them
        self.layers = torch.nn.ModuleList(
            _layer(layers, kind, config, first + i + 1, groups) for i, kind in enumerate(kinds)
        )
        h = config.hidden_size
        for d in range(depths):
            start, end = self.layers[d * self.width], self.layers[(d + 1) * self.width - 1]
            start.enorm, start.hnorm = SPNorm(config, h), SPNorm(config, h)
            start.eh_proj = torch.nn.Linear(2 * h, h, bias=False)
            end.final_layernorm = SPNorm(config, h)

    def depth(self, d: int, hidden: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """Depth ``d``'s output [b, s, h] at each position of ``hidden`` [b, s, h] (aligned with
        ``embedded``: the next tokens'); the layers run sequence-first, as in the decoder."""
        layers = self.layers[d * self.width : (d + 1) * self.width]
        start: Any = layers[0]
        x = start.eh_proj(torch.cat([start.enorm(embedded), start.hnorm(hidden)], dim=-1))
        x = x.transpose(0, 1).contiguous()
        for layer in layers:
            # no mask: causal, and right padding sits after every real token (as the decoder runs)
            out = layer(hidden_states=x, attention_mask=None)
            x = out[0] if isinstance(out, tuple) else out  # TransformerLayer: (hidden, context)
        end: Any = layers[-1]
        return end.final_layernorm(x).transpose(0, 1)


def _layer(layers: dict[str, Any], kind: str, config: Any, number: int, groups: Any) -> Any:
    """A decoder layer of ``kind`` as the hybrid stack builds it (MambaLayer needs the groups passed)."""
    return build(layers[SLOT[kind]], config=config, layer_number=number, pg_collection=groups)


def attach(model: Any, config: Any, layers: dict[str, Any], kinds: str, depths: int) -> None:
    """Give ``model`` (one stage: the whole model) its MTP layers as the ``mtp_block`` submodule."""
    device = next(model.parameters()).device
    model.mtp_block = MTPBlock(config, layers, kinds, depths, model.pg_collection).to(device)


class MTPLoss:
    """The MTP layers' loss on a micro-batch, added to the policy loss as the fsdp backend adds it
    (trainer/mtp.py's ``MTPLoss.add``): times the scale, each micro-batch an equal share."""

    def __init__(self, model: Any, scale: float, detach: bool, tied: bool, dtype: torch.dtype) -> None:
        self.model, self.scale, self.detach, self.tied, self.dtype = model, scale, detach, tied, dtype

    def value(self, hidden: torch.Tensor, ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        """The mean over depths of each depth's mean NLL on its loss tokens; ``hidden`` [b, s, h] the
        model's final hidden states (after the final norm)."""
        model, hidden = self.model, hidden.to(self.dtype)  # as the log-prob head casts it
        embedding = model.embedding.word_embeddings
        head = model.shared_embedding_or_output_weight() if self.tied else model.output_layer.weight
        embed: Callable[[torch.Tensor], torch.Tensor] = embedding
        if self.detach:  # the loss reaches the MTP layers only, not the decoder, embedding or head
            hidden, head = hidden.detach(), head.detach()
            embed = lambda tokens: embedding(tokens).detach()  # noqa: E731
        # the loss runs outside the schedule's autocast: the layers run under it as the decoder's did
        mixed = self.dtype != torch.float32
        cast = torch.autocast(hidden.device.type, dtype=self.dtype) if mixed else nullcontext()
        with torch.set_grad_enabled(self.scale > 0 and torch.is_grad_enabled()), cast:
            return shared.nll(
                model.mtp_block.depth,
                model.mtp_block.depths,
                hidden,
                ids,
                loss_mask,
                embed,
                head.to(hidden.dtype),
            )

    def add(
        self, loss: torch.Tensor, metrics: dict[str, Any], value: torch.Tensor, micro_batches: int
    ) -> torch.Tensor:
        metrics["mtp_loss"] = value.detach() / micro_batches
        return loss + self.scale * value / micro_batches
