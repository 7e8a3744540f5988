"""A Nemotron-H's multi-token-prediction (MTP) layers in a transformers model (the fsdp backend, the
tiny model builder; ``trainer.mtp_loss_scale``).

transformers builds no MTP layers (``NemotronHForCausalLM`` drops the checkpoint's ``mtp.*`` on load),
so hpcrl holds them: ``MTPLayers`` is the model's ``mtp`` submodule, in the checkpoint's layout (what
vLLM's ``NemotronHMTP`` and Megatron-Bridge read): ``mtp.layers.{i}`` for ``i`` over the depths times
the block's pattern (``mtp_layers_block_type``; Super: attention, MoE), each a Nemotron-H block
(``norm``, ``mixer``); a depth's first layer also has ``enorm``, ``hnorm`` and ``eh_proj``
[h, 2h], its last ``final_layernorm``. Being named as in the checkpoint, they load, export and refit
through the model's own paths (its conversion mapping splits their experts as the decoder's).

Depth k (from 0) at position t: ``eh_proj([enorm(embed(x[t+k+1])); hnorm(h[t])])`` through the
block's layers and ``final_layernorm``, then the model's head, predicts ``x[t+k+2]``; ``h`` is the
model's last hidden state (after ``norm_f``) for depth 0, the previous depth's output after that
(Megatron's ``MultiTokenPredictionBlock``; vLLM drafts the same way). Its loss (``nll``, which the
megatron backend's layers share: megatron/mtp.py) is the mean negative log-likelihood over the loss
tokens among those targets, averaged over the depths. Each depth runs on the whole width with the
tokens rolled by its offset, as Megatron's MTP does (a sequence-parallel split of the width stays
even): the rolled-in tail sits after every loss token, and the layers being causal it changes none.

Packed rows (``trainer.packing``): the roll hands a sequence's last positions the next sequence's first
tokens. Those positions score nothing (at depth k the last k+2 of each sequence have their target
past it, as the padded rows' tail: ``nll``'s ``seq`` and ``Packed.loss_mask`` mask them), and the MTP layers attend and scan inside each sequence
as the decoder's layers do (the row's bounds: the packed attention, ``seq_idx`` for Mamba mixers), so no
loss position reads them: the loss and its gradients are the padded rows'.

Context parallel (megatron, ``trainer.cp``): the hidden states are a rank's chunks of each row, the
tokens and masks whole rows (``on_chunks``).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hpcrl.trainer.logprob_head import chunked_logprob
from hpcrl.trainer.packing import Packed
from hpcrl.trainer.ssd import seq_index


class MTPLayers(nn.Module):
    def __init__(self, config: Any, depths: int) -> None:
        from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHBlock, NemotronHRMSNorm

        super().__init__()
        kinds = list(config.mtp_layers_block_type)
        first = len(config.layers_block_type)
        # the blocks take their kind from the config by index: after the decoder's, as vLLM numbers them
        extended = copy.copy(config)
        extended.layers_block_type = list(config.layers_block_type) + kinds * depths
        self.depths, self.width = depths, len(kinds)
        self.layers = nn.ModuleList(NemotronHBlock(extended, first + i) for i in range(depths * len(kinds)))
        block: Any
        for block in self.layers:
            if block.block_type == "full_attention":
                # attention reads its implementation from its config at each call: the model's own, so
                # a packed forward's switch to per-sequence attention (trainer/varlen.py) reaches it
                block.mixer.config = config
        h, eps = config.hidden_size, config.layer_norm_epsilon
        for d in range(depths):
            start, end = self.layers[d * self.width], self.layers[(d + 1) * self.width - 1]
            start.enorm, start.hnorm = NemotronHRMSNorm(h, eps=eps), NemotronHRMSNorm(h, eps=eps)
            start.eh_proj = nn.Linear(2 * h, h, bias=False)
            end.final_layernorm = NemotronHRMSNorm(h, eps=eps)

    def units(self) -> list[nn.Module]:
        """The modules to make an FSDP unit each, children before the layers holding them: a unit
        gathers its weights only when its own forward runs, and a depth's projections and final norm
        run outside their layer's forward."""
        out: list[nn.Module] = []
        for d in range(self.depths):
            layers = list(self.layers[d * self.width : (d + 1) * self.width])
            start: Any = layers[0]
            end: Any = layers[-1]
            out += [start.enorm, start.hnorm, start.eh_proj, end.final_layernorm, *layers]
        return out

    def depth(
        self, d: int, hidden: torch.Tensor, embedded: torch.Tensor, seq_idx: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Depth ``d``'s output at each position of ``hidden`` (aligned with ``embedded``: the next
        tokens); ``seq_idx``: a packed row's sequences, where the Mamba mixers restart (fsdp/segments.py)."""
        layers = self.layers[d * self.width : (d + 1) * self.width]
        start: Any = layers[0]  # a Nemotron-H block with the depth's projections attached
        x = start.eh_proj(torch.cat([start.enorm(embedded), start.hnorm(hidden)], dim=-1))
        row = {} if seq_idx is None else {"seq_idx": seq_idx}
        for layer in layers:
            # no mask: causal, and right padding sits after every real token (as the decoder runs)
            x = layer(x, attention_mask=None, **row)
        end: Any = layers[-1]
        return end.final_layernorm(x)

    def nll(
        self,
        hidden: torch.Tensor,
        ids: torch.Tensor,
        loss_mask: torch.Tensor,
        embed: Callable[[torch.Tensor], torch.Tensor],
        head: torch.Tensor,
        seq: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``nll`` through these layers; ``seq``: a packed row's sequence index [1, L] (run inside
        ``varlen.packed_attention`` of the same row)."""

        def logp(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return chunked_logprob(out, head, targets)[0]

        depth = self.depth if seq is None else functools.partial(self.depth, seq_idx=seq)
        return nll(depth, self.depths, hidden, ids, loss_mask, embed, logp, seq)


def nll(
    depth: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor],
    depths: int,
    hidden: torch.Tensor,
    ids: torch.Tensor,
    loss_mask: torch.Tensor,
    embed: Callable[[torch.Tensor], torch.Tensor],
    logp: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    seq: torch.Tensor | None = None,
) -> torch.Tensor:
    """The mean over depths of each depth's mean negative log-likelihood on its loss tokens (both
    backends' MTP layers: ``depth(d, hidden, embedded)``, ``embed(ids)``, ``logp(out, targets)`` ->
    log p(target) [B, T], in whatever layout the backend's layers hold a row: fsdp [B, T, h], megatron
    [T, B, h]). ``hidden``: the last hidden state (after ``norm_f``), ``ids`` [B, T], ``loss_mask``
    [B, T-1] (at target ``ids[:, 1:]``). A packed row: ``seq`` [1, L], each position's sequence
    (ssd.py's ``seq_index``), ``loss_mask`` the row's (``Packed.loss_mask``: 0 at each sequence's last
    position), and ``depth`` keeps its layers inside each sequence (the caller binds the row's bounds)."""
    width, total = ids.shape[1], hidden.new_zeros((), dtype=torch.float32)
    for d in range(depths):
        # position t: the previous depth's output there and token t+d+1, predicting token t+d+2
        hidden = depth(d, hidden, embed(ids.roll(-(d + 1), 1)))
        mask = loss_mask[:, d + 1 :].to(torch.float32)
        mask = torch.nn.functional.pad(mask, (0, width - mask.shape[1]))  # the rolled-in tail: none
        if seq is not None:  # packed: token t+d+1 in t's sequence (so t+d+2 too, where the mask counts)
            mask = mask * (seq == seq.roll(-(d + 1), 1))
        total = total - (logp(hidden, ids.roll(-(d + 2), 1)) * mask).sum() / mask.sum().clamp(min=1)
    return total / depths


def on_chunks(
    embed: Callable[[torch.Tensor], torch.Tensor],
    logp: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    split: Callable[[torch.Tensor], torch.Tensor],
    join: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """``nll``'s ``embed`` and ``logp`` for a context-parallel rank, which runs its chunks of every row
    (``split``: [B, T] -> this rank's [B, T/cp]) through the MTP layers: ``nll`` rolls the whole row's
    tokens (every rank holds all of them), this rank embeds and scores its chunks of the rolled row, so
    the roll crosses chunk and rank bounds without an exchange (Megatron's ``roll_tensor`` trades the
    edge tokens instead: its ranks hold only their chunks); ``join`` gathers the log-probs back to
    [B, T] (the gradient to the rank that computed each), where ``nll``'s masks and means run."""
    return (lambda ids: embed(split(ids))), (lambda out, targets: join(logp(out, split(targets))))


class MTPLoss:
    """Computes the MTP layers' loss inside the model's forward (a hook on its decoder, whose output
    is the last hidden state: the root unit's embedding and head are gathered there) while armed with
    the micro-batch's loss mask; ``take`` hands it over once."""

    def __init__(self, model: Any, scale: float, detach: bool) -> None:
        self.model, self.scale, self.detach = model, scale, detach
        self.loss_mask: torch.Tensor | None = None
        self.seq: torch.Tensor | None = None
        self.value: torch.Tensor | None = None
        model.get_decoder().register_forward_hook(self._hook, with_kwargs=True)

    def arm(self, loss_mask: torch.Tensor, packed: Packed | None = None) -> None:
        """``loss_mask``: the micro-batch's rows'; ``packed``: the row they run as (``trainer.packing``)."""
        self.loss_mask = loss_mask if packed is None else packed.loss_mask(loss_mask)
        self.seq = None if packed is None else seq_index(packed.positions)

    def _hook(self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        if self.loss_mask is None:  # log-prob passes: no MTP
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        model, embedding = self.model, self.model.get_input_embeddings()
        hidden, head = out.last_hidden_state, model.lm_head.weight
        embed: Callable[[torch.Tensor], torch.Tensor] = embedding
        if self.detach:  # the loss reaches the MTP layers only, not the decoder, embedding or head
            hidden, head = hidden.detach(), head.detach()
            embed = lambda tokens: embedding(tokens).detach()  # noqa: E731
        with torch.set_grad_enabled(self.scale > 0 and torch.is_grad_enabled()):
            self.value = model.mtp.nll(hidden, ids, self.loss_mask, embed, head, self.seq)
        self.loss_mask = self.seq = None

    def add(self, loss: torch.Tensor, metrics: dict[str, Any], micro_batches: int) -> torch.Tensor:
        """``loss`` plus this micro-batch's MTP loss times the scale, each micro-batch's an equal
        share of the minibatch's (Megatron's per-micro-batch token mean); ``mtp_loss`` into ``metrics``."""
        value, self.value = self.value, None
        assert value is not None, "the MTP loss was armed but the model's decoder did not run"
        metrics["mtp_loss"] = value.detach() / micro_batches
        return loss + self.scale * value / micro_batches


def attach(model: Any, depths: int) -> None:
    """Give ``model`` (on the meta device or not) its MTP layers as the ``mtp`` submodule."""
    model.mtp = MTPLayers(model.config, depths)


def depths_of(config: Any) -> int:
    """MTP depths the checkpoint ships (``num_nextn_predict_layers``)."""
    return int(getattr(config, "num_nextn_predict_layers", 0) or 0)


def kinds_of(config: Any) -> str:
    """The MTP layers' kinds over every depth, one symbol a layer as in the decoder's pattern (the
    megatron backend's ``Shape.mtp``); empty for a model without them."""
    return str(getattr(config, "mtp_hybrid_override_pattern", "") or "") * depths_of(config)
