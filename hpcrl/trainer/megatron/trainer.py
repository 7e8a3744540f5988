"""The Megatron-core Trainer: a GPTModel split by tensor/pipeline parallelism from the topology,
loaded from Hugging Face safetensors, trained with the same GRPO/DAPO loss as the fsdp backend.

Data: ranks of one data-parallel group see the same shard. Per optimizer step the shard is cut
into equal micro-batches (a short last one is padded with zero-weight rows, as the pipeline
schedules need one tensor shape) and run through Megatron's forward/backward schedule; gradients
are summed over context parallel and averaged over data parallel, tied-embedding copies summed over
the embedding group, the norm clipped over the model-parallel group, then AdamW steps (its state
sharded as Megatron's distributed optimizer: optimizer.py). A vision-language checkpoint trains its
text decoder (weights.LanguageModel); Gemma 3's own modules are in gemma.py. Logprobs come
from the last pipeline stage (vocab-parallel log-softmax across TP) and are broadcast to the whole
pipeline.

Context parallel: each CP rank feeds its two chunks of every sequence (``_cp_split``) and gathers
the per-token log-probs back into whole sequences (``_cp_join``; the gradient returns to the rank
that computed each token), so the loss is the same on every CP rank and its parameter gradients
cover that rank's tokens: their sum over CP is the whole sequence's.
"""

from __future__ import annotations

import math
import os
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpcrl.algo.losses import gen_kl_error, grpo_loss
from hpcrl.config.schema import RunConfig
from hpcrl.plan.topology import TrainParallel
from hpcrl.trainer.batch import TrainBatch
from hpcrl.trainer.config import MEGATRON_FAMILIES, MegatronTrainerConfig
from hpcrl.trainer.fsdp import init_process_group
from hpcrl.trainer.logprob_head import chunked_logprob, soft_cap
from hpcrl.trainer.megatron import compat
from hpcrl.trainer.megatron.optimizer import ShardedAdamW
from hpcrl.trainer.megatron.spec import (
    cp_gather,
    family,
    family_of,
    keep_pad_row_untrained,
    layer_spec,
    num_experts,
    text_config,
    transformer_config,
    uses_fused_norms,
)
from hpcrl.trainer.megatron.weights import (
    LanguageModel,
    Shape,
    is_expert,
    is_sharded,
    is_split,
    relocate,
    shard,
    to_hf,
    to_megatron,
    unshard,
)


def load_hf_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(f))
    return out


def model_shape(hf: Any, tp: int) -> Shape:
    heads = hf.num_attention_heads
    padded = math.ceil(hf.vocab_size / tp) * tp
    fam = family_of(hf)
    return Shape(
        heads=heads,
        groups=hf.num_key_value_heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
        vocab=hf.vocab_size,
        padded_vocab=padded,
        fused_norms=uses_fused_norms(fam),
        sandwich_norms=fam.sandwich_norms,
        layers=fam.attention_layouts(hf),
        moe_block=fam.moe_block,
    )


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
    ) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel
        from megatron.core.models.gpt import GPTModel

        compat.prepare(device)
        t = cfg.trainer
        assert isinstance(t, MegatronTrainerConfig), "make_trainer picks this backend for trainer=megatron"
        if device == "cuda":  # torchrun: one GPU per local rank; a Ray actor sees only its own GPU
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
            torch.cuda.set_device(device)
        self.cfg, self.device = cfg, torch.device(device)
        self.par = TrainParallel(world=world, tp=t.tp, pp=t.pp, cp=t.cp, ep=t.ep, expert_tp=t.expert_tp)
        # a vision-language checkpoint (Gemma 3 4B+): the text decoder is trained, the vision tower
        # stays frozen in the rollout engines (weights.LanguageModel)
        hf = text_config(model_dir)
        name = family(hf)
        if name not in MEGATRON_FAMILIES:
            raise ValueError(
                f"trainer=megatron cannot build model_type {hf.model_type!r} yet "
                f"(supported: {', '.join(MEGATRON_FAMILIES)}); use trainer=fsdp for {model_dir}"
            )
        experts = num_experts(hf)
        if experts and t.moe_gap(hf.model_type):  # the planner refuses it before submitting
            raise ValueError(t.moe_gap(hf.model_type))
        if experts % self.par.ep:
            raise ValueError(f"trainer.ep={self.par.ep} must divide the model's {experts} experts")
        if hf.num_hidden_layers % self.par.pp:
            raise ValueError(
                f"trainer.pp={self.par.pp} must divide the model's {hf.num_hidden_layers} layers"
            )
        init_process_group(rank, world, master, "nccl" if device.startswith("cuda") else "gloo")
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(
                tensor_model_parallel_size=self.par.tp,
                pipeline_model_parallel_size=self.par.pp,
                context_parallel_size=self.par.cp,
                expert_model_parallel_size=self.par.ep,
                expert_tensor_parallel_size=self.par.expert_tp if experts else None,
            )
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.run.seed)
        self.ps = ps
        self.tied = bool(getattr(hf, "tie_word_embeddings", False))
        self.shape = model_shape(hf, self.par.tp)
        config = transformer_config(hf, t, self.par, device=device)

        arch = self.arch = family_of(hf)
        # At TP=1 the loss reads log-probs from the final hidden states in chunks, never the logits
        # (trainer/logprob_head.py); under TP the vocab-parallel cross-entropy keeps the logits split.
        self.fused_head = t.chunked_logprob()
        self.compute_dtype = torch.bfloat16 if config.enable_autocast else torch.float32

        def build() -> Any:
            model = GPTModel(
                config=config,
                transformer_layer_spec=layer_spec(config, arch),
                vocab_size=self.shape.padded_vocab,
                max_sequence_length=hf.max_position_embeddings,
                pre_process=ps.is_pipeline_first_stage(),
                post_process=ps.is_pipeline_last_stage(),
                share_embeddings_and_output_weights=self.tied,
                position_embedding_type="rope",
                **arch.rope(hf),
            )
            arch.adapt_model(model, hf, self.compute_dtype)
            keep_pad_row_untrained(model, hf)
            return with_hidden_output(model.to(self.device), self.fused_head)

        self.layer_offset = hf.num_hidden_layers // self.par.pp * ps.get_pipeline_model_parallel_rank()
        self.moe = experts > 0
        self.expert_offset = experts // self.par.ep * ps.get_expert_model_parallel_rank() if experts else 0
        self.lm = LanguageModel.of(load_hf_weights(model_dir))
        full = to_megatron(self.lm.text, self.shape, self.tied)
        self.model = build()
        if t.compile_layers() and self.device.type == "cuda":
            for layer in getattr(getattr(self.model, "decoder", None), "layers", []):
                # An MoE layer compiles its attention only: the token dispatcher calls record_stream,
                # which torch.compile cannot functionalize (every Qwen3-MoE step raised on an H200).
                (layer.self_attention if self.moe else layer).compile()
        self._load(self.model, full)
        self._check_every_weight_used(full, hf.model_type)
        # The frozen reference policy for the KL term (a second model: Megatron modules hold process
        # groups, which cannot be deep-copied).
        self.ref = None
        if cfg.algo.kl_coef > 0:
            self.ref = build().eval().requires_grad_(False)
            self._load(self.ref, full)
        for name in t.freeze:
            for pname, param in self.model.named_parameters():
                if name in pname:
                    param.requires_grad_(False)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # Experts differ per EP rank: their grads are reduced over the expert-DP group, not the DP one.
        self.expert_params = [p for n, p in self.model.named_parameters() if p.requires_grad and is_expert(n)]
        self.dense_params = [
            p for n, p in self.model.named_parameters() if p.requires_grad and not is_expert(n)
        ]
        # Replicated over TP but computed from this rank's part: norms under sequence parallelism (a
        # slice of the sequence), Q/K norms always (this rank's heads). Megatron sums them over TP.
        self.tp_partial = [
            p
            for name, p in self.model.named_parameters()
            if p.requires_grad
            and (getattr(p, "sequence_parallel", False) or "q_layernorm" in name or "k_layernorm" in name)
        ]
        self.optimizer = self._make_optimizer()

    def _make_optimizer(self) -> ShardedAdamW:
        """AdamW; with ``trainer.distributed_optimizer`` its state (m, v) is sharded as Megatron's
        distributed optimizer does (ZeRO-1): dense weights over data x context parallel, experts over
        their expert-data-parallel group (optimizer.py)."""
        t, algo = self.cfg.trainer, self.cfg.algo
        assert isinstance(t, MegatronTrainerConfig)
        kwargs: dict[str, Any] = {
            "lr": algo.lr,
            "weight_decay": t.weight_decay,
            "betas": (0.9, 0.999),
            "fused": True if self.device.type == "cuda" else None,
        }
        shard = t.distributed_optimizer
        dense = self.ps.get_data_parallel_group(with_context_parallel=True) if shard else None
        expert = self.ps.get_expert_data_parallel_group() if shard and self.expert_params else None
        return ShardedAdamW([(self.dense_params, dense), (self.expert_params, expert)], **kwargs)

    def local_optimizer(self) -> ShardedAdamW:
        """The optimizer holding this rank's state (``.state``: its shards)."""
        return self.optimizer

    # -- weights -----------------------------------------------------------------------------------
    def _tp_of(self, name: str) -> tuple[int, int, Any]:
        """(size, this rank's index, group) of the tensor-parallel group ``name`` is split over: expert
        TP for an expert's weights, the dense TP group for the rest."""
        ps = self.ps
        if is_expert(name):
            return (
                self.par.expert_tp,
                ps.get_expert_tensor_parallel_rank(),
                ps.get_expert_tensor_parallel_group(check_initialized=False),
            )
        return self.par.tp, ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()

    def _loaded(self, model: Any) -> list[tuple[str, torch.Tensor]]:
        """What the checkpoint fills: the parameters and the family's checkpoint buffers (Gemma 4's
        ``layer_scalar``)."""
        buffers = [(n, b) for n, b in model.named_buffers() if n.rsplit(".", 1)[-1] in self.arch.buffers]
        return [*model.named_parameters(), *buffers]

    def _load(self, model: Any, full: dict[str, torch.Tensor]) -> None:
        """Every parameter from ``full``; the checkpoint buffers too where ``full`` has them (a training
        checkpoint holds the trained weights only: the buffers stay as the model directory had them)."""
        with torch.no_grad():
            for name, param in self._loaded(model):
                key = relocate(name, self.layer_offset, self.expert_offset)
                if key not in full:
                    if not isinstance(param, torch.nn.Parameter):
                        continue
                    raise KeyError(f"checkpoint has no weight for Megatron parameter {key}")
                tp, rank, _ = self._tp_of(name)
                param.copy_(shard(key, full[key], tp, rank).to(param.dtype))

    def _check_every_weight_used(self, full: dict[str, torch.Tensor], model_type: str) -> None:
        """Every checkpoint weight must land in some rank's model: one left over means the layer
        spec lacks a part of the architecture (a Q/K norm, say) and the model would silently differ."""
        used = {relocate(name, self.layer_offset, self.expert_offset) for name, _ in self._loaded(self.model)}
        every: list[Any] = [used]
        if dist.get_world_size() > 1:
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, used)
        left = set(full) - set().union(*every) - ({"output_layer.weight"} if self.tied else set())
        if left:
            raise ValueError(
                f"trainer=megatron built a {model_type} model with no place for {len(left)} "
                f"checkpoint weights, e.g. {sorted(left)[:3]}: its layer spec does not match "
                "the architecture; use trainer=fsdp for this model"
            )

    def _local_full(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """This stage's parameters (or their gradients), gathered over tensor parallel (expert TP for
        experts), under global Megatron names."""
        out = {}
        for name, param in self.model.named_parameters():
            if grads and param.grad is None:
                continue
            data = param.grad.detach() if grads else param.detach()
            tp, _, group = self._tp_of(name)
            if tp > 1 and is_split(name):
                parts = [torch.empty_like(data) for _ in range(tp)]
                dist.all_gather(parts, data.contiguous(), group=group)
            else:
                parts = [data]
            out[relocate(name, self.layer_offset, self.expert_offset)] = unshard(name, parts).cpu()
        return out

    def _gather_to_rank0(self, local: Any) -> list[Any]:
        if dist.get_world_size() == 1:
            return [local]
        objs: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(local, objs, dst=0)
        return objs or []

    def export_weights(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Full weights (or the last step's gradients) in HF names on global rank 0 (empty elsewhere):
        TP gathered, stages merged."""
        local = self._local_full(grads)  # collective over TP: every rank takes part
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
        for part in self._gather_to_rank0(mine):
            merged.update(part or {})
        return self.lm.named(to_hf(merged, self.shape, self.tied)) if merged else {}

    def state_dict(self) -> dict[str, Any]:
        """Whole model (HF names) and every rank's optimizer state, on rank 0: resume needs the same layout."""
        model = self.export_weights()
        return {"model": model, "optimizer": self._gather_to_rank0(self.local_optimizer().state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load(self.model, to_megatron(LanguageModel.of(state["model"]).text, self.shape, self.tied))
        self.local_optimizer().load_state_dict(
            state["optimizer"][dist.get_rank() if dist.is_initialized() else 0]
        )

    def data_rank(self) -> tuple[int, int]:
        return self.ps.get_data_parallel_rank(), self.par.dp

    # -- forward -----------------------------------------------------------------------------------
    def _token_stats(
        self, model: Any, out: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """log p(target) and entropy per token: from the final hidden states [b, s, h] in chunks
        (``fused_head``), else vocab-parallel from this rank's [b, s, vocab/tp] logits."""
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        targets = self._cp_split(targets)
        if self.fused_head:
            weight = model.shared_embedding_or_output_weight() if self.tied else model.output_layer.weight
            # the loss runs outside the schedule's autocast: cast as autocast would have
            logp, entropy = chunked_logprob(
                out.to(self.compute_dtype),
                weight.to(self.compute_dtype),
                targets,
                cap=self.arch.final_logit_softcap,
            )
            return self._cp_join(logp), self._cp_join(entropy)
        logits = soft_cap(out.float(), self.arch.final_logit_softcap)  # as HF caps them, before log-softmax
        group = self.ps.get_tensor_model_parallel_group()
        with torch.no_grad():  # entropy is a metric: all-reduced pieces of logsumexp and E[logit]
            m = logits.max(-1).values
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            e = torch.exp(logits - m[..., None])
            z, s = e.sum(-1), (e * logits).sum(-1)
            dist.all_reduce(z, group=group)
            dist.all_reduce(s, group=group)
            entropy = torch.log(z) + m - s / z
        logp = -vocab_parallel_cross_entropy(logits, targets)
        return self._cp_join(logp), self._cp_join(entropy)

    def _cp_split(self, t: torch.Tensor) -> torch.Tensor:
        """This context-parallel rank's part of [b, s]: chunks r and 2·cp-1-r of 2·cp (Megatron's layout)."""
        cp = self.par.cp
        if cp == 1:
            return t
        rank = self.ps.get_context_parallel_rank()
        chunks = t.chunk(2 * cp, dim=1)
        return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=1)

    def _cp_join(self, t: torch.Tensor) -> torch.Tensor:
        """[b, s/cp] per CP rank -> the whole [b, s] on every CP rank (inverse of ``_cp_split``); the
        backward keeps only this rank's part of the gradient (each rank holds the same loss)."""
        if self.par.cp == 1:
            return t
        return cp_gather(t.t(), self.ps.get_context_parallel_group(), sum_grads=False).t()

    def _micro_batches(self, batch: TrainBatch) -> list[TrainBatch]:
        """Equal micro-batches (pipeline schedules pass one tensor shape), width a multiple of TP
        (sequence parallel splits it over TP) and of 2·CP (context parallel's chunks)."""
        size = min(self.cfg.trainer.micro_batch_size, len(batch))
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

    def _run(self, model: Any, mbs: list[TrainBatch], loss_fn: Any, forward_only: bool) -> list[Any]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
            i, mb = next(data_iterator)
            ids = mb.input_ids.to(self.device)
            pos = torch.arange(ids.shape[1], device=self.device).expand_as(ids)
            out = model(input_ids=self._cp_split(ids), position_ids=self._cp_split(pos), attention_mask=None)
            return out, partial(loss_fn, i, mb)

        return list(
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(enumerate(mbs)),
                model=[model],
                num_microbatches=len(mbs),
                seq_length=mbs[0].input_ids.shape[1],
                micro_batch_size=len(mbs[0]),
                forward_only=forward_only,
            )
        )

    def _targets(self, mb: TrainBatch) -> torch.Tensor:
        ids = mb.input_ids.to(self.device)
        return torch.nn.functional.pad(ids[:, 1:], (0, 1))  # the last position predicts nothing we use

    def _broadcast_from_last_stage(self, obj: Any) -> Any:
        if self.par.pp == 1:
            return obj
        box = [obj]
        src = self.ps.get_pipeline_model_parallel_last_rank()
        dist.broadcast_object_list(box, src=src, group=self.ps.get_pipeline_model_parallel_group())
        return box[0]

    def logprobs(self, batch: TrainBatch, reference: bool = False) -> torch.Tensor:
        model = self.ref if reference else self.model
        assert model is not None, "no reference model: algo.kl_coef is 0"
        n, width = len(batch), batch.input_ids.shape[1] - 1

        def keep_logp(i: int, mb: TrainBatch, logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
            logp, _ = self._token_stats(model, logits, self._targets(mb))
            return logits.new_zeros(()), {"logp": logp.detach().cpu()}

        model.eval()
        with torch.no_grad():
            outs = self._run(model, self._micro_batches(batch), keep_logp, forward_only=True)
        logp = torch.cat([o["logp"] for o in outs])[:n, :width] if outs else None
        return self._broadcast_from_last_stage(logp)

    def train_step(self, batch: TrainBatch, ref_logp: torch.Tensor | None) -> dict[str, float]:
        algo = self.cfg.algo
        old_all = None if algo.num_minibatches == 1 else self.logprobs(batch)
        sums = dict.fromkeys(("loss", "policy_loss", "kl", "clip_fraction", "entropy", "gen_kl_error"), 0.0)
        grad_norm = 0.0
        self.model.train()
        for chunk in torch.arange(len(batch)).chunk(algo.num_minibatches):
            minibatch = batch.select(chunk)
            tokens = float(minibatch.loss_mask.sum().clamp(min=1))
            mbs = self._micro_batches(minibatch)
            size = len(mbs[0])

            def loss_fn(
                i: int,
                mb: TrainBatch,
                logits: torch.Tensor,
                _chunk: Any = chunk,
                _tokens: float = tokens,
                _k: int = len(mbs),
                _size: int = size,
            ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
                targets = self._targets(mb)
                logp, entropy = self._token_stats(self.model, logits, targets)
                w = mb.loss_mask.shape[1]
                logp, entropy = logp[:, :w], entropy[:, :w]
                rows = _chunk[i * _size : (i + 1) * _size]
                real = len(rows)  # the rest are zero-weight padding rows
                mask = mb.loss_mask.to(self.device)
                old = logp.detach() if old_all is None else _rows(old_all, rows, real, logp)
                ref = None if ref_logp is None else _rows(ref_logp, rows, real, logp)
                terms = grpo_loss(
                    logp,
                    old,
                    ref,
                    mb.rollout_logp.to(self.device),
                    mb.advantages.to(self.device),
                    mask,
                    eps_low=algo.eps_low,
                    eps_high=algo.eps_high,
                    dual_clip=algo.dual_clip,
                    kl_coef=algo.kl_coef,
                    kl_type=algo.kl_type,
                    agg=algo.loss_agg,
                    is_correction=algo.is_correction,
                    is_cap=algo.is_cap,
                )
                share = float(mb.loss_mask.sum()) / _tokens  # host tensor: no wait on the GPU
                # device tensors, converted once after the schedule (a float() here would stall it)
                stats = {
                    "loss": terms.loss.detach() * share,
                    "policy_loss": terms.policy * share,
                    "kl": terms.kl * share,
                    "clip_fraction": terms.clip_fraction * share,
                    "entropy": (entropy.detach() * mask).sum() / _tokens,
                    "gen_kl_error": gen_kl_error(old, mb.rollout_logp.to(self.device), mask) * share,
                }
                # the schedule divides by the number of micro-batches; the token share is the real weight
                return terms.loss * share * _k, stats

            self.optimizer.zero_grad(set_to_none=True)
            outs = _as_floats(self._run(self.model, mbs, loss_fn, forward_only=False))
            for stats in self._broadcast_from_last_stage(outs):
                for key, value in stats.items():
                    sums[key] += value
            self._finalize_grads()
            grad_norm += self._clip_grads(self.cfg.trainer.grad_clip)
            self.optimizer.step()
        self.model.eval()
        k = algo.num_minibatches
        metrics = {key: value / k for key, value in sums.items() if key != "gen_kl_error"}
        metrics["gen_kl_error"] = sums["gen_kl_error"] / k
        metrics["grad_norm"] = grad_norm / k
        return metrics

    # -- gradients ---------------------------------------------------------------------------------
    def _finalize_grads(self) -> None:
        """What Megatron's DDP would do: sum over context parallel and average over data parallel, sum
        the TP-partial norm grads over TP, sum the two tied-embedding copies (first and last stage)
        over their group."""
        ps = self.ps
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
        if self.par.pp > 1 and self.tied and ps.is_rank_in_embedding_group():
            weight = self.model.shared_embedding_or_output_weight()
            dist.all_reduce(weight.grad, group=ps.get_embedding_group())

    def _clip_grads(self, max_norm: float) -> float:
        """Global L2 norm over the model-parallel group; TP-replicated and tied copies counted once."""
        tp_rank = self.ps.get_tensor_model_parallel_rank()
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
        dist.all_reduce(sq, group=self.ps.get_model_parallel_group())
        if self.moe:  # each EP rank (and pipeline stage) holds different experts
            dist.all_reduce(expert_sq, group=self.ps.get_expert_tensor_model_pipeline_parallel_group())
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


def _as_floats(outs: list[dict[str, torch.Tensor]]) -> list[dict[str, float]]:
    """The schedule's per-micro-batch metric tensors as floats, in one host sync."""
    if not outs:
        return []  # not the last pipeline stage
    keys = list(outs[0])
    values = torch.stack([torch.stack([o[k].float() for k in keys]) for o in outs]).tolist()
    return [dict(zip(keys, row, strict=True)) for row in values]


class HiddenOutput(torch.nn.Module):
    """Stands in for ``GPTModel.output_layer`` (and keeps its weight, so names and the optimizer's
    parameters do not change): the model returns its final hidden states [b, s, h] instead of logits."""

    def __init__(self, layer: Any) -> None:
        super().__init__()
        self.weight = layer.weight  # None when tied to the input embedding

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        return hidden, None


def with_hidden_output(model: Any, enabled: bool) -> Any:
    if enabled and getattr(model, "output_layer", None) is not None:
        model.output_layer = HiddenOutput(model.output_layer)
    return model


def _rows(full: torch.Tensor, rows: torch.Tensor, real: int, like: torch.Tensor) -> torch.Tensor:
    """Rows of a [B, T-1] tensor for one micro-batch, zero rows for its padding, shaped like ``like``."""
    out = torch.zeros_like(like)
    part = full[rows].to(like.device, like.dtype)
    out[:real, : min(part.shape[1], out.shape[1])] = part[:, : out.shape[1]]
    return out


def _concat(parts: list[TrainBatch]) -> TrainBatch:
    return TrainBatch(
        *(
            torch.cat([getattr(p, f) for p in parts])
            for f in ("input_ids", "attention_mask", "loss_mask", "advantages", "rollout_logp")
        )
    )


def _widen(batch: TrainBatch, width: int) -> TrainBatch:
    grow = width - batch.input_ids.shape[1]
    pad = torch.nn.functional.pad
    return TrainBatch(
        pad(batch.input_ids, (0, grow)),
        pad(batch.attention_mask, (0, grow)),
        pad(batch.loss_mask, (0, grow)),
        batch.advantages,
        pad(batch.rollout_logp, (0, grow)),
    )
