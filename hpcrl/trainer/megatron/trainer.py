"""The Megatron-core Trainer: a GPTModel split by tensor/pipeline/context/expert parallelism from
the topology, loaded from Hugging Face safetensors, trained by the shared step (trainer/step.py) with
the same GRPO/DAPO loss as the fsdp backend.

Data: ranks of one data-parallel group see the same shard. The step's micro-batches go through
Megatron's forward/backward schedule (pipeline.py); gradients are then reduced as Megatron's DDP
would and clipped over the model-parallel group (grads.py), and AdamW steps (its state sharded as
Megatron's distributed optimizer: optimizer.py). Building the model is model.py's; which part of it
this rank holds, and moving weights in and out, placement.py's (the checkpoint streams in through
load.py: each rank reads only its part). A vision-language checkpoint trains
its text decoder (weights.LanguageModel).
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from hpcrl.config.schema import RunConfig
from hpcrl.core.parallel import TrainParallel
from hpcrl.trainer import kernels
from hpcrl.trainer import mtp as shared_mtp
from hpcrl.trainer.base import WeightSink, freeze
from hpcrl.trainer.batch import TrainBatch
from hpcrl.trainer.config import MegatronTrainerConfig
from hpcrl.trainer.hf_checkpoint import HFCheckpoint
from hpcrl.trainer.megatron import compat, mtp, weights, weights_hybrid
from hpcrl.trainer.megatron.grads import Gradients
from hpcrl.trainer.megatron.load import Source, stream_checkpoint
from hpcrl.trainer.megatron.model import (
    build_model,
    check_buildable,
    compile_layers,
    init_parallel,
    keep_autocast_in_recompute,
    model_shape,
)
from hpcrl.trainer.megatron.optimizer import ShardedAdamW
from hpcrl.trainer.megatron.pipeline import Pipeline, as_floats, fit
from hpcrl.trainer.megatron.placement import Placement, gather_to_rank0
from hpcrl.trainer.megatron.router_replay import RouteReplay
from hpcrl.trainer.megatron.router_replay import install as install_route_replay
from hpcrl.trainer.megatron.sharded import Pieces, model_pieces, optimizer_pieces, restorable
from hpcrl.trainer.megatron.spec import (
    describe_layers,
    family_of,
    text_config,
    transformer_config,
    uses_local_spec,
)
from hpcrl.trainer.megatron.stream import WeightStream
from hpcrl.trainer.megatron.weights import LanguageModel, is_expert
from hpcrl.trainer.process_group import collective_backend, init_process_group
from hpcrl.trainer.shards import ShardWriter, init_optimizer_state
from hpcrl.trainer.step import LossFn, Metrics, StepBatch, TrainStep, set_lr

log = logging.getLogger(__name__)


class MegatronTrainer:
    def __init__(
        self,
        model_dir: Path,
        cfg: RunConfig,
        *,
        rank: int = 0,
        world: int = 1,
        master: str = "127.0.0.1:29518",
        device: str = "cpu",
        par: TrainParallel | None = None,
    ) -> None:
        """``par``: the plan's degrees (the job's ``Fleet`` hands them); None: ``trainer.*``'s."""
        from megatron.core import parallel_state as ps

        compat.prepare(device)
        t = cfg.trainer
        assert isinstance(t, MegatronTrainerConfig), "make_trainer picks this backend for trainer=megatron"
        if device == "cuda":  # torchrun: one GPU per local rank; a Ray actor sees only its own GPU
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
            torch.cuda.set_device(device)
        self.cfg, self.device = cfg, torch.device(device)
        self.par = par if par is not None else t.parallel(world)
        # a vision-language checkpoint (Gemma 3 4B+): the text decoder is trained, the vision tower
        # stays frozen in the rollout engines (weights.LanguageModel)
        hf = text_config(model_dir)
        self.arch = family_of(hf)  # one family object: it has run its checks on ``hf``
        experts = check_buildable(hf, self.arch, t, self.par)
        init_process_group(rank, world, master, collective_backend(device))
        init_parallel(self.par, experts > 0, cfg.run.seed)
        self.ps = ps
        self.data_group = ps.get_data_parallel_group() if self.par.dp > 1 else None
        """The ranks that train different rows (``data_rank``): the step's metrics are reduced over them."""
        self.tied = bool(getattr(hf, "tie_word_embeddings", False))
        self.te = not uses_local_spec(self.arch, device)
        """Transformer Engine's layers (spec.uses_local_spec decides), logged beside the Kernels line."""
        log.warning("[hpcrl] trainer=megatron layers on %s: %s", device, describe_layers(self.arch, self.te))
        self.shape = model_shape(hf, self.arch, self.par.tp, self.te)
        # HF <-> Megatron names: a hybrid model's own mapping, or the GPT families'
        self.weights = weights_hybrid if self.shape.pattern else weights
        if "M" in (self.shape.pattern or ""):  # the Mamba mixers' path (trainer/kernels.py), logged once
            kernels.configure(t.kernels, device)
        config = transformer_config(hf, self.arch, t, self.par, device=device, te=self.te)
        self.step = TrainStep.from_config(cfg)
        self._build_models(model_dir, hf, config, experts)
        self.grads = Gradients(
            self.model,
            self.par,
            tied=self.tied,
            moe=experts > 0,
            device=self.device,
            mtp=bool(self.shape.mtp),
        )
        self.optimizer = self._make_optimizer()
        self.writer = ShardWriter()

    def _build_models(self, model_dir: Path, hf: Any, config: Any, experts: int) -> None:
        """This rank's part of the policy (trainable but for ``trainer.freeze``) and of the frozen
        reference, loaded from the checkpoint; the pipeline that runs them."""
        t = self.cfg.trainer
        # At TP=1 the loss reads log-probs from the final hidden states in chunks, never the logits
        # (trainer/logprob_head.py); under TP the vocab-parallel cross-entropy keeps the logits split.
        chunked, softcap = t.chunked_logprob(self.par.tp), self.arch.final_logit_softcap
        compute_dtype = torch.bfloat16 if config.enable_autocast else torch.float32
        budget = self.step.pack_tokens
        # sequence parallel splits the packed row by TP, context parallel into 2·CP chunks
        unit = self.par.tp * (2 * self.par.cp if self.par.cp > 1 else 1)
        width = None if budget is None else -(-budget // unit) * unit
        replay = RouteReplay() if t.router_replay else None
        self.pipeline = Pipeline(
            self.par, self.device, chunked, self.tied, compute_dtype, softcap, width, replay
        )
        build = partial(
            build_model,
            config,
            hf,
            self.arch,
            self.shape,
            tied=self.tied,
            compute_dtype=compute_dtype,
            device=self.device,
            hidden_output=chunked,
            te=self.te,
        )
        parts = weights_hybrid.partitions(self.shape) if self.shape.pattern else None
        self.placement = Placement.of_this_rank(
            self.par, hf.num_hidden_layers, experts, self.arch.buffers, parts
        )
        self.model = build()
        keep_autocast_in_recompute(self.model, config)  # the reference never recomputes: eval
        self.mtp = self._attach_mtp(hf, config, compute_dtype)
        if t.compile_layers() and self.device.type == "cuda":
            compile_layers(self.model, moe=experts > 0)
        # The frozen reference policy for the KL term (a second model: Megatron modules hold process
        # groups, which cannot be deep-copied), filled in the same pass over the checkpoint.
        self.ref = build().eval().requires_grad_(False) if self.cfg.algo.kl_coef > 0 else None
        if replay is not None:  # the reference too: both sides of the KL on the engine's experts
            for m in (self.model, self.ref):
                if m is not None:
                    install_route_replay(m, replay, recomputes=t.activation_checkpointing)
        with HFCheckpoint(model_dir) as ckpt:
            # names and shapes only: export_weights names the text decoder's weights as the checkpoint does
            self.lm = LanguageModel.of({n: ckpt.meta(n) for n in ckpt.names()})
            models = [m for m in (self.model, self.ref) if m is not None]
            source = Source(ckpt, self.lm, self.weights, self.shape, self.tied)
            every = stream_checkpoint(source, self.placement, models)
        self.placement.check_every_weight_used(self.model, every, self.tied, hf.model_type)
        freeze(self.model, t.freeze)

    def _attach_mtp(self, hf: Any, config: Any, dtype: torch.dtype) -> mtp.MTPLoss | None:
        """With ``trainer.mtp_loss_scale``: the policy's MTP layers (the reference needs none) on the
        last pipeline stage, named in ``shape.mtp`` (on every stage: rank 0 exports them) so the
        checkpoint's ``mtp.*`` fill them, and their loss (None on the other stages)."""
        t = self.cfg.trainer
        if t.mtp_loss_scale is None:
            return None
        if not self.shape.pattern:  # the plan refused it (plan/mtp.py)
            raise ValueError("trainer=megatron carries the MTP layers of a hybrid model (Nemotron-H) only")
        if self.tied and self.par.pp > 1:  # the plan refused it (backends.py's _megatron_mtp_gap)
            raise ValueError(
                "trainer.mtp_loss_scale with trainer.pp > 1 needs untied embeddings (tie_word_embeddings "
                "is true in this checkpoint): set trainer.pp=1"
            )
        kinds = shared_mtp.kinds_of(hf)
        self.shape = replace(self.shape, mtp=kinds)
        if not self.ps.is_pipeline_last_stage():
            return None
        mtp.attach(
            self.model, config, self.arch.stack_layers(hf, config, self.te), kinds, shared_mtp.depths_of(hf)
        )
        return mtp.MTPLoss(self.model, t.mtp_loss_scale, t.mtp_detach, self.tied, dtype, self.pipeline)

    def _make_optimizer(self) -> ShardedAdamW:
        """AdamW; with ``trainer.distributed_optimizer`` its state (m, v) is sharded as Megatron's
        distributed optimizer does (ZeRO-1): dense weights over data x context parallel, experts over
        their expert-data-parallel group (optimizer.py)."""
        t, algo = self.cfg.trainer, self.cfg.algo
        assert isinstance(t, MegatronTrainerConfig)
        kwargs: dict[str, Any] = {
            "lr": algo.lr,
            "weight_decay": t.weight_decay,
            "betas": t.adamw_betas(),
            "fused": True if self.device.type == "cuda" else None,
        }
        shard = t.distributed_optimizer
        dense = self.ps.get_data_parallel_group(with_context_parallel=True) if shard else None
        experts = self.grads.expert_params
        expert = self.ps.get_expert_data_parallel_group() if shard and experts else None
        return ShardedAdamW([(self.grads.dense_params, dense), (experts, expert)], **kwargs)

    def local_optimizer(self) -> ShardedAdamW:
        """The optimizer holding this rank's state (``.state``: its shards)."""
        return self.optimizer

    # -- weights -----------------------------------------------------------------------------------
    def weight_metas(self) -> list[tuple[str, tuple[int, ...]]]:
        """What this rank sends the engines (stream.py: each stage's and expert rank's first rank)."""
        return WeightStream(self).metas()

    def stream_weights(self, sink: WeightSink | None, dtype: torch.dtype) -> None:
        WeightStream(self).stream(sink, dtype)

    def export_weights(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Full weights (or the last step's gradients) in HF names on global rank 0 (empty elsewhere):
        TP gathered, stages merged. For tests and small models: the whole model on one rank (the
        engines get theirs through ``stream_weights``)."""
        local = self.placement.gather_tp(self.model, grads)  # collective over TP: every rank takes part
        ps = self.ps
        first = (
            ps.get_data_parallel_rank() == 0
            and ps.get_tensor_model_parallel_rank() == 0
            and ps.get_context_parallel_rank() == 0
        )
        # experts: one copy of each, from the first of the ranks that hold it (its expert-DP group;
        # expert-TP rank 0 of those, which gathered the whole expert)
        first_expert = ps.get_expert_data_parallel_rank() == 0 and ps.get_expert_tensor_parallel_rank() == 0
        mine = {k: v for k, v in local.items() if (first_expert if is_expert(k) else first)}
        merged: dict[str, torch.Tensor] = {}
        for part in gather_to_rank0(mine):
            merged.update(part or {})
        return self.lm.named(self.weights.to_hf(merged, self.shape, self.tied)) if merged else {}

    # -- checkpoints: every rank writes its own pieces (trainer/shards.py, megatron/sharded.py) ------
    def _pieces(self, optimizer: bool) -> dict[str, Any]:
        pieces = Pieces(self.placement, self.shape.vocab, self.tied)
        state = model_pieces(pieces, self.placement.loaded(self.model))
        if optimizer:
            local = self.optimizer.local()
            for opt in local:
                init_optimizer_state(opt)  # a load fills the state: it must exist
            state |= optimizer_pieces(pieces, self.model, local)
        return state

    def save_checkpoint(self, path: str, async_save: bool) -> float:
        """This rank's weights and Adam state into the DCP checkpoint at ``path``; seconds blocked."""
        return self.writer.save(self._pieces(optimizer=True), path, async_save)

    def finish_checkpoint(self) -> float:
        return self.writer.wait()

    def load_checkpoint(self, path: str, weights_only: bool = False) -> None:
        """Weights (and Adam state) from a checkpoint of any TP/PP/EP/DP layout of this model."""
        state = self._pieces(optimizer=not weights_only)
        self.writer.load(restorable(state, path), path)

    def data_rank(self) -> tuple[int, int]:
        return self.ps.get_data_parallel_rank(), self.par.dp

    # -- forward -----------------------------------------------------------------------------------
    def logprobs(self, batch: TrainBatch, reference: bool = False) -> torch.Tensor:
        """Scored in eval mode; the model's mode is left as it was (the step scores the old policy
        between setting train mode and training)."""
        model = self.ref if reference else self.model
        assert model is not None, "no reference model: algo.kl_coef is 0"
        n, width = len(batch), batch.input_ids.shape[1] - 1

        def keep_logp(i: int, mb: StepBatch, out: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
            logp, _ = self.pipeline.token_stats(model, out, mb.data)
            return out.new_zeros(()), {"logp": logp.detach().cpu()}

        groups = self.step.cut(batch.attention_mask.sum(dim=1)) if self.step.pack_tokens else None
        if groups is not None:  # packed: the step's bins, one packed row each, as many as on every rank
            real = len(groups)
            self.step.even(groups, self.data_group, self.device)
            mbs = [StepBatch(batch.select(g), None, None) for g in groups]
            groups = groups[:real]
        else:
            datas = self.pipeline.micro_batches(batch, self.cfg.trainer.logprob_rows())
            mbs = [StepBatch(d, None, None) for d in datas]
        training = model.training
        model.eval()
        with torch.no_grad():
            outs = self.pipeline.run(model, mbs, keep_logp, forward_only=True)
        model.train(training)
        logp = _rows(outs[: len(groups)] if groups else outs, groups, n, width) if outs else None
        return self.pipeline.from_last_stage(logp)

    def train_step(self, batch: TrainBatch, lr: float | None = None) -> dict[str, float]:
        set_lr((group for opt in self.optimizer.parts for group in opt.param_groups), lr)
        self.model.train()
        metrics = self.step(self, batch, self.device)
        self.model.eval()
        return metrics

    # -- the step's backend (trainer/step.py) -------------------------------------------------------
    def micro_batches(self, part: StepBatch, groups: list[torch.Tensor]) -> list[StepBatch]:
        if self.step.pack_tokens is not None:  # the pipeline packs each group into one row
            return [part.select(g) for g in groups]
        # runs of equal rows in order, the last one padded
        datas = self.pipeline.micro_batches(part.data, len(groups[0]))
        rows = [slice(i * len(datas[0]), (i + 1) * len(datas[0])) for i in range(len(datas))]
        return [
            StepBatch(d, fit(part.old_logp, r, d.loss_mask), fit(part.ref_logp, r, d.loss_mask))
            for d, r in zip(datas, rows, strict=True)
        ]

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def forward_backward(self, micro_batches: list[StepBatch], loss_fn: LossFn) -> list[Metrics]:
        """Through Megatron's schedule: the loss runs on the last pipeline stage, its metrics come back
        as floats (one host sync) broadcast to every stage."""
        k = len(micro_batches)

        def loss(i: int, mb: StepBatch, out: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
            logp, entropy = self.pipeline.token_stats(self.model, out, mb.data)
            w = mb.data.loss_mask.shape[1]
            value, metrics = loss_fn(i, mb, logp[:, :w], entropy[:, :w])
            if self.mtp is not None:  # on the final hidden states the output layer took (packed: its row)
                ids, packed = mb.data.input_ids.to(self.device), None
                if self.step.pack_tokens is not None:
                    packed = self.pipeline.packed(mb.data)
                extra = self.mtp.value(ids, mb.data.loss_mask.to(self.device), packed)
                value = self.mtp.add(value, metrics, extra, k)
            # the schedule divides by the number of micro-batches; the token share is the real weight
            return value * k, metrics

        outs = as_floats(self.pipeline.run(self.model, micro_batches, loss, forward_only=False))
        return list(self.pipeline.from_last_stage(outs))

    def optimizer_step(self) -> float:
        self.grads.finalize()
        norm = self.grads.clip(self.cfg.trainer.grad_clip)
        self.optimizer.step()
        return norm


def _rows(outs: list[Any], groups: list[torch.Tensor] | None, n: int, width: int) -> torch.Tensor:
    """The log-prob passes' micro-batch outputs as the batch's [n, width] rows (packed: the bins'
    rows back in their places)."""
    parts = [o["logp"][:, :width] for o in outs]
    if groups is None:
        return torch.cat(parts)[:n]
    logp = torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])
    return torch.empty_like(logp).index_copy_(0, torch.cat(groups), logp)
