"""A hybrid model's multi-token-prediction (MTP) layers in the megatron backend
(``trainer.mtp_loss_scale``; the fsdp backend's are trainer/mtp.py's, with the same math).

``MTPBlock`` is the model's ``mtp_block`` submodule (megatron-core's schedules take a model's
``mtp`` for its own MultiTokenPredictionBlock): ``mtp_block.layers.<i>`` for ``i`` over the depths times the
block's pattern (``mtp_layers_block_type``), each a layer of the decoder's own kind built from the
same specs (families' ``stack_layers``: Mamba, attention, MoE, MLP), numbered after the decoder's; a
depth's first layer also holds ``enorm``, ``hnorm`` and ``eh_proj`` [h, 2h], its last
``final_layernorm``. Named so, the checkpoint's ``mtp.layers.<i>.*`` load, export and refit through
weights_hybrid.py by the same rules as the decoder's layers: under tensor parallelism their
projections are cut as the decoder's, ``eh_proj`` column-parallel (as Megatron's own MTP layer), and
under expert parallelism their experts go to the ranks the decoder's go to (weights.relocate).

The loss runs beside the policy loss on the last stage's output. Its input is the decoder's final
hidden states as the output layer takes them ([s, b, h]; [s/tp, b, h] under sequence parallelism),
kept by a hook on the output layer; the token embedding and the output head are the model's: the
chunked head at TP=1 (trainer/logprob_head.py), else the vocab-parallel one the policy loss uses. Each
depth runs on the whole width with the tokens rolled by its offset (as Megatron's MTP does), so a
sequence-parallel split stays even: the rolled-in tail sits after every loss token and, all layers
being causal, changes none of them. Under context parallel (``trainer.cp``) the layers run each CP
rank's two chunks of every row as the decoder's do (attention on the gathered keys, Mamba mixers on
whole sequences for a share of the heads), and each depth embeds and scores that rank's chunks of the
whole row's rolled tokens, its log-probs gathered back to whole rows as the policy loss's (so the roll
crosses chunk and rank bounds: trainer/mtp.py's ``on_chunks``). Packed rows (``trainer.packing``): the
loss runs on the packed row with its sequences' bounds (``packed_seq_params``, as the decoder's layers
take them), each depth's targets inside their sequence (trainer/mtp.py). Router replay
(``trainer.router_replay``) replays the decoder's routers only; the MTP layers' route freely, as fsdp's
(megatron/router_replay.py's ``install``). Under pipeline parallelism (``trainer.pp``) the block sits
on the last stage, as Megatron's MTP does, with a copy of the first stage's input embedding
(``embedding``, Megatron's name there too): loaded from the same weight, its gradient summed with the
first stage's (grads.py, as for a tied head), so the two stay equal; the refit and the checkpoint take
the first stage's.

Imports Megatron-core: imported only where a Megatron model is built.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from typing import Any

import torch
from megatron.core import tensor_parallel as tpar
from megatron.core.transformer.module import MegatronModule

from hpcrl.trainer import mtp as shared
from hpcrl.trainer.logprob_head import chunked_logprob
from hpcrl.trainer.megatron.norms import SPNorm
from hpcrl.trainer.megatron.pipeline import Pipeline, seq_params
from hpcrl.trainer.megatron.spec_utils import build
from hpcrl.trainer.packing import Packed
from hpcrl.trainer.ssd import seq_index

SLOT = {"M": "mamba_layer", "*": "attention_layer", "-": "mlp_layer", "E": "moe_layer"}


class MTPBlock(MegatronModule):
    def __init__(self, config: Any, layers: dict[str, Any], kinds: str, depths: int, groups: Any) -> None:
        """``kinds``: one symbol a layer over every depth (``Shape.mtp``); ``groups``: the model's
        process groups (its ``pg_collection``)."""
        super().__init__(config)
        self.depths, self.width, self.tp_group = depths, len(kinds) // depths, groups.tp
        first = config.num_layers  # numbered after the decoder's layers, as vLLM numbers them
        self.layers = torch.nn.ModuleList(
            _layer(layers, kind, config, first + i + 1, groups) for i, kind in enumerate(kinds)
        )
        h = config.hidden_size
        for d in range(depths):
            start, end = self.layers[d * self.width], self.layers[(d + 1) * self.width - 1]
            start.enorm, start.hnorm = SPNorm(config, h), SPNorm(config, h)
            start.eh_proj = tpar.ColumnParallelLinear(
                2 * h, h, config=config, init_method=config.init_method, bias=False, tp_group=groups.tp
            )
            end.final_layernorm = SPNorm(config, h)

    def depth(
        self, d: int, hidden: torch.Tensor, embedded: torch.Tensor, packed_seq_params: Any = None
    ) -> torch.Tensor:
        """Depth ``d``'s output at each position of ``hidden`` (aligned with ``embedded``: the next
        tokens'), all three [s, b, h] as the decoder's layers take them ([s/tp, b, h] under sequence
        parallelism); ``packed_seq_params``: a packed row's bounds, as the decoder's layers got them."""
        layers = self.layers[d * self.width : (d + 1) * self.width]
        start: Any = layers[0]
        # column parallel, as Megatron's MTP layer: [s, b, h/tp] (the sequence gathered under SP),
        # then every rank's columns, then this rank's part of the sequence again
        x, _ = start.eh_proj(torch.cat([start.enorm(embedded), start.hnorm(hidden)], dim=-1))
        x = tpar.gather_from_tensor_model_parallel_region(x, group=self.tp_group)
        if self.config.sequence_parallel:
            x = tpar.scatter_to_sequence_parallel_region(x, group=self.tp_group)
        for layer in layers:
            # no mask: causal, and right padding sits after every real token (as the decoder runs)
            out = layer(hidden_states=x, attention_mask=None, packed_seq_params=packed_seq_params)
            x = out[0] if isinstance(out, tuple) else out  # TransformerLayer: (hidden, context)
        end: Any = layers[-1]
        return end.final_layernorm(x)


def _layer(layers: dict[str, Any], kind: str, config: Any, number: int, groups: Any) -> Any:
    """A decoder layer of ``kind`` as the hybrid stack builds it (MambaLayer needs the groups passed)."""
    return build(layers[SLOT[kind]], config=config, layer_number=number, pg_collection=groups)


def attach(model: Any, config: Any, layers: dict[str, Any], kinds: str, depths: int) -> None:
    """Give ``model`` (the last pipeline stage: the whole model at PP=1) its MTP layers as the
    ``mtp_block`` submodule, and a stage without the input embedding a copy of it (``embedding``)."""
    device = next(model.parameters()).device
    model.mtp_block = MTPBlock(config, layers, kinds, depths, model.pg_collection).to(device)
    if getattr(model, "embedding", None) is None:
        model.embedding = embedding_copy(model, config).to(device)


def embedding_copy(model: Any, config: Any) -> Any:
    """The input embedding as the first stage builds it (megatron-core's own MTP stage holds one too),
    for the MTP layers on the last stage. Its weight is marked ``shared``: a copy, counted once in the
    gradient norm (grads.py), as a tied head's copy is."""
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding

    embedding = LanguageModelEmbedding(
        config=config,
        vocab_size=model.vocab_size,
        max_sequence_length=model.max_sequence_length,
        position_embedding_type="none",
        tp_group=model.pg_collection.tp,
    )
    embedding.word_embeddings.weight.shared = True
    return embedding


class MTPLoss:
    """The MTP layers' loss on a micro-batch, added to the policy loss as the fsdp backend adds it
    (trainer/mtp.py's ``MTPLoss.add``): times the scale, each micro-batch an equal share."""

    def __init__(
        self, model: Any, scale: float, detach: bool, tied: bool, dtype: torch.dtype, pipeline: Pipeline
    ) -> None:
        """``pipeline``: the model's forward (its head's kind, its context-parallel split and join)."""
        self.model, self.scale, self.detach, self.tied, self.dtype = model, scale, detach, tied, dtype
        self.chunked, self.pipeline = pipeline.chunked_head, pipeline
        self.hidden: torch.Tensor | None = None
        model.output_layer.register_forward_pre_hook(self._keep)

    def _keep(self, _module: Any, args: tuple[Any, ...]) -> None:
        """The final hidden states of a training forward (log-prob passes need no MTP)."""
        self.hidden = args[0] if torch.is_grad_enabled() else None

    def value(self, ids: torch.Tensor, loss_mask: torch.Tensor, packed: Packed | None = None) -> torch.Tensor:
        """The mean over depths of each depth's mean NLL on its loss tokens (trainer/mtp.py's ``nll``)
        on the micro-batch the model just ran: ``ids`` [b, s], ``loss_mask`` [b, s-1] (at ``ids[:, 1:]``);
        ``packed``: the row it ran as (``trainer.packing``), the loss inside each of its sequences.
        Under context parallel the layers run this rank's chunks of the rows (the decoder's hidden
        states), the tokens and masks are whole (trainer/mtp.py's ``on_chunks``)."""
        hidden, self.hidden = self.hidden, None
        block, seq = self.model.mtp_block, None
        depth: Callable[..., torch.Tensor] = block.depth
        if packed is not None:
            ids, loss_mask, seq = packed.ids, packed.loss_mask(loss_mask), seq_index(packed.positions)
            depth = partial(block.depth, packed_seq_params=seq_params(packed))
        assert hidden is not None, "the MTP loss needs the training forward's final hidden states"
        model, hidden = self.model, hidden.to(self.dtype)  # as the log-prob head casts it
        head = model.shared_embedding_or_output_weight() if self.tied else model.output_layer.weight
        embed: Callable[[torch.Tensor], torch.Tensor] = self._embed
        if self.detach:  # the loss reaches the MTP layers only, not the decoder, embedding or head
            hidden, head = hidden.detach(), head.detach()
            embed = lambda tokens: self._embed(tokens).detach()  # noqa: E731
        # the loss runs outside the schedule's autocast: the layers run under it as the decoder's did
        mixed = self.dtype != torch.float32
        cast = torch.autocast(hidden.device.type, dtype=self.dtype) if mixed else nullcontext()
        with torch.set_grad_enabled(self.scale > 0 and torch.is_grad_enabled()), cast:
            cp = self.pipeline
            embed, logp = shared.on_chunks(embed, partial(self._logp, head), cp.cp_split, cp.cp_join)
            return shared.nll(depth, block.depths, hidden, ids, loss_mask, embed, logp, seq)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The model's token embedding of ``ids`` [b, s] as its decoder takes it: [s(/tp), b, h]."""
        return self.model.embedding(input_ids=ids, position_ids=None)

    def _logp(self, head: torch.Tensor, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """log p(target) [b, s] of the output head at ``hidden`` [s(/tp), b, h], as the policy loss
        reads it: in chunks at TP=1, else from vocab-parallel logits through the model's output layer
        (which gathers the sequence under sequence parallelism)."""
        targets = targets.t().contiguous()  # [s, b], as the layers hold the sequence
        if self.chunked:
            logp, _ = chunked_logprob(hidden.to(self.dtype), head.to(self.dtype), targets)
            return logp.t()
        logits, _ = self.model.output_layer(hidden, weight=head)
        self.hidden = None  # its hook kept the MTP layers' output: not a forward of the model's
        return -tpar.vocab_parallel_cross_entropy(logits.float(), targets).t()

    def add(
        self, loss: torch.Tensor, metrics: dict[str, Any], value: torch.Tensor, micro_batches: int
    ) -> torch.Tensor:
        metrics["mtp_loss"] = value.detach() / micro_batches
        return loss + self.scale * value / micro_batches
