"""``FSDPTrainer``: the Trainer of the fsdp backend (the package docstring tells how it trains)."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpcrl.config.schema import RunConfig
from hpcrl.core.parallel import TrainParallel
from hpcrl.rollout.backends import sleeps
from hpcrl.sync.packer import let_go
from hpcrl.trainer import mtp
from hpcrl.trainer.base import CollectSink, WeightSink, freeze, numel_of
from hpcrl.trainer.batch import TrainBatch
from hpcrl.trainer.context_parallel import CPGroup, use_cp_attention
from hpcrl.trainer.forward import is_right_padded, packed_logprobs, token_logprobs
from hpcrl.trainer.fsdp.model import (
    checkpoint_names,
    data_parallel_group,
    frozen_buffers,
    has_recurrent_layers,
    position_dependent_rope,
    shard_model,
)
from hpcrl.trainer.fsdp.optim import StateStore, make_optimizer
from hpcrl.trainer.fsdp.segments import reset_at_sequence_starts, use_kernels
from hpcrl.trainer.hf_load import load_sharded, meta_model
from hpcrl.trainer.logprob_head import install_logprob_head
from hpcrl.trainer.packing import Packed
from hpcrl.trainer.process_group import collective_backend, init_process_group
from hpcrl.trainer.router_replay import install as install_route_replay
from hpcrl.trainer.shards import ShardWriter
from hpcrl.trainer.step import LossFn, Metrics, StepBatch, TrainStep, set_lr
from hpcrl.trainer.varlen import recompute_context


class FSDPTrainer:
    def __init__(
        self,
        model_dir: Path,
        cfg: RunConfig,
        *,
        rank: int = 0,
        world: int = 1,
        master: str = "127.0.0.1:29517",
        device: str = "cpu",
        par: TrainParallel | None = None,
    ) -> None:
        """``par``: the plan's degrees (the job's ``Fleet`` hands them); None: ``trainer.*``'s."""
        self.cfg, self.device = cfg, device
        self.par = par if par is not None else cfg.trainer.parallel(world)
        init_process_group(rank, world, master, collective_backend(device))
        torch.manual_seed(cfg.run.seed + rank)
        model = self._empty_model(model_dir)
        if cfg.trainer.mtp_loss_scale is not None:  # the policy's only: the reference needs none
            with torch.device("meta"):  # filled from the checkpoint's mtp.* with the rest
                mtp.attach(model, mtp.depths_of(model.config))
        freeze(model, cfg.trainer.freeze)
        self.unsent = frozen_buffers(model, cfg.trainer.freeze)
        """Buffers ``trainer.freeze`` names (Nemotron-H's router correction bias) and frozen parameters
        (a vision-language model's towers): they never change and engines load them from the
        checkpoint, so refits leave them out (checkpoints keep them). Not the parameters where engines
        sleep: a level-2 sleep frees every weight, and each refit sends them all."""
        if not sleeps(cfg.rollout):
            self.unsent |= {n for n, p in model.named_parameters() if not p.requires_grad}
        self.recurrent = has_recurrent_layers(model)
        self.cp = self._context_parallel(model, world)
        self.data_group = data_parallel_group(world, self.cp.size)
        """The ranks that train different rows (``data_rank``): the step's metrics are reduced over them."""
        self.model = shard_model(model, cfg, device, world, self.par.ep)
        scale = cfg.trainer.mtp_loss_scale
        self.mtp = None if scale is None else mtp.MTPLoss(self.model, scale, cfg.trainer.mtp_detach)
        self.ref = None
        """The frozen reference policy for the KL term (``algo.kl_coef > 0``): a second model sharded
        exactly like the policy (same units, same mixed precision), filled in the policy's loading
        pass from the same checkpoint reads — never a whole copy on any rank."""
        if cfg.algo.kl_coef > 0:
            ref = self._empty_model(model_dir).eval().requires_grad_(False)
            self.ref = shard_model(ref, cfg, device, world, self.par.ep)
        load_sharded([m for m in (self.model, self.ref) if m is not None], model_dir, device)
        self.optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad], cfg, device)
        self.store = StateStore(self.optimizer, cfg, device, rank)
        """Where the optimizer's state lives between steps (``trainer.optimizer_dtype``, ``_offload``)."""
        self.step = TrainStep.from_config(cfg)
        if self.recurrent:
            kernels = use_kernels(cfg.trainer.kernels, device)
            if self.step.pack_tokens is not None:  # each packed sequence from zeros (fsdp/segments.py)
                reset_at_sequence_starts(kernels)
        self.writer = ShardWriter()
        self._conversions: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
        """State-dict name -> the checkpoint tensors it becomes (``_hf_metas``)."""
        self._right_padded = True
        """Whether this step's batch is right-padded (``token_logprobs``), checked once per step."""

    def _empty_model(self, model_dir: Path) -> Any:
        """The checkpoint's model on the meta device, with everything that precedes sharding."""
        model = meta_model(model_dir)
        if self.cfg.trainer.chunked_logprob(self.par.tp):
            install_logprob_head(model)
        if self.cfg.trainer.router_replay:
            install_route_replay(model)  # the reference too: both sides of the KL on the engine's experts
        if self.par.cp > 1:
            use_cp_attention(model)  # attention through the CP group (trainer/context_parallel.py)
        if self.cfg.trainer.activation_checkpointing:
            # each decoder layer's forward runs again in the backward instead of keeping its
            # activations; non-reentrant: FSDP's hooks run again too (torchtitan, NeMo RL's DTensor path)
            # context_fn: a packed row's bounds for the recompute too (trainer/varlen.py)
            kwargs = {"use_reentrant": False, "context_fn": recompute_context}
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return model

    def _context_parallel(self, model: Any, world: int) -> CPGroup:
        """``trainer.cp``'s groups, after the checks the model's own config allows (the planner's read
        the catalog)."""
        cp = self.par.cp
        if cp > 1 and self.recurrent:
            raise ValueError(
                "trainer=fsdp splits sequences over attention only: a model with Mamba layers needs "
                "trainer.cp=1 (or trainer=megatron, whose Mamba mixer splits heads under CP)"
            )
        if cp > 1 and (kind := position_dependent_rope(model.config)):
            raise ValueError(
                f"trainer.cp={cp}: {kind} RoPE scales by the longest position in the call, which differs "
                "between CP ranks; set trainer.cp=1"
            )
        return CPGroup.make(world, cp) if cp > 1 else CPGroup(1, 0, None)

    def data_rank(self) -> tuple[int, int]:
        """(data-parallel rank, size): the ranks of one CP group train the same rows."""
        if not dist.is_initialized():
            return 0, 1
        return dist.get_rank() // self.cp.size, dist.get_world_size() // self.cp.size

    def logprobs(self, batch: TrainBatch, reference: bool = False) -> torch.Tensor:
        model = self.ref if reference else self.model
        assert model is not None, "no reference model: algo.kl_coef is 0"
        mask_ok = is_right_padded(batch.attention_mask)
        batch = batch.to(self.device)  # the driver sends CPU tensors
        out = []
        groups = self._logprob_groups(batch)
        real = len(groups)
        self.step.even(groups, self.data_group, self.device)  # as many forwards as every other rank
        with torch.no_grad():
            for rows in groups:
                out.append(self._forward(model, batch.select(rows), mask_ok)[0])
        groups, out = groups[:real], out[:real]
        logp = _cat_padded(out)
        if self.step.pack_tokens is not None:  # bins hold rows out of order: put each back in its place
            logp = torch.empty_like(logp).index_copy_(0, torch.cat(groups).to(logp.device), logp)
        return logp.cpu()

    def _logprob_groups(self, batch: TrainBatch) -> list[torch.Tensor]:
        """Rows of each log-prob forward: ``logprob_rows`` at a time, or packed, the step's bins."""
        if self.step.pack_tokens is not None:
            return self.step.cut(batch.attention_mask.sum(dim=1).cpu())
        return list(torch.arange(len(batch)).split(self.cfg.trainer.logprob_rows()))

    def _forward(
        self, model: Any, batch: TrainBatch, right_padded: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropy [rows, T-1] of one micro-batch, packed into one row if the step packs."""
        if self.step.pack_tokens is None:
            return token_logprobs(model, batch, right_padded=right_padded, cp=self.cp)
        if not right_padded:
            raise ValueError("trainer.packing packs right-padded batches only (what build_batch makes)")
        return packed_logprobs(model, batch, self.recurrent)

    def _packed_row(self, batch: TrainBatch) -> Packed | None:
        """The packed row ``_forward`` runs ``batch`` as; None where the step does not pack."""
        return None if self.step.pack_tokens is None else Packed.of(batch.input_ids, batch.attention_mask)

    def train_step(self, batch: TrainBatch, lr: float | None = None) -> dict[str, float]:
        set_lr(self.optimizer.param_groups, lr)
        self._right_padded = is_right_padded(batch.attention_mask)  # on the driver's CPU tensors, once
        if self.recurrent and not self._right_padded:
            # the fused Mamba training kernel (GPUs) does not mask padding after its convolution
            raise ValueError("fsdp: a model with Mamba layers trains on right-padded batches only")
        self.model.train()
        metrics = self.step(self, batch, self.device)
        self.model.eval()
        return metrics

    # -- the step's backend (trainer/step.py) -------------------------------------------------------
    def micro_batches(self, part: StepBatch, groups: list[torch.Tensor]) -> list[StepBatch]:
        return [part.select(g) for g in groups]

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def forward_backward(self, micro_batches: list[StepBatch], loss_fn: LossFn) -> list[Metrics]:
        out = []
        for i, mb in enumerate(micro_batches):
            if self.mtp is not None:  # packed: on the row _forward runs, inside each of its sequences
                self.mtp.arm(mb.data.loss_mask, self._packed_row(mb.data))
            logp, entropy = self._forward(self.model, mb.data, self._right_padded)
            loss, metrics = loss_fn(i, mb, logp, entropy)
            if self.mtp is not None:
                loss = self.mtp.add(loss, metrics, len(micro_batches))
            loss.backward()
            out.append(metrics)
        return out

    def optimizer_step(self) -> torch.Tensor:
        norm = clip_grad_norm(list(self.model.parameters()), self.cfg.trainer.grad_clip)
        self.store.step()
        return norm

    # -- weights to the engines: one tensor at a time (sync/packer.py packs them) ------------------
    def _sent(self) -> list[tuple[str, torch.Tensor]]:
        """(state-dict name, this rank's sharded tensor) of everything the engines load, in order;
        a tied lm_head as the embedding it is (vLLM's in-place reload does not re-tie it)."""
        state = self.model.state_dict()
        sent = [(k, v) for k, v in state.items() if isinstance(v, torch.Tensor) and k not in self.unsent]
        if self._tied() and "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
            sent.append(("lm_head.weight", state["model.embed_tokens.weight"]))
        return sent

    def weight_metas(self) -> list[tuple[str, tuple[int, ...]]]:
        """Rank 0 sends everything (each tensor gathered over data parallel when its turn comes)."""
        if dist.get_rank() != 0:
            return []
        return [m for name, t in self._sent() for m in self._hf_metas(name, t.shape)]

    def _hf_metas(self, name: str, shape: torch.Size) -> list[tuple[str, tuple[int, ...]]]:
        """The checkpoint tensors one state-dict tensor becomes (transformers' conversion on a meta
        tensor of its global shape); remembered, so plain tensors skip the conversion when streamed."""
        if name not in self._conversions:
            shaped = {name: torch.empty(shape, device="meta")}
            got = [(n, tuple(v.shape)) for n, v in checkpoint_names(self.model, shaped).items()]
            self._conversions[name] = got
        return self._conversions[name]

    def stream_weights(self, sink: WeightSink | None, dtype: torch.dtype) -> None:
        """Every rank gathers each tensor whole (an all-gather), so any rank may send: rank 0 to a
        broadcast, every rank to the engine on its own GPU (CUDA IPC)."""
        world = dist.get_world_size()
        # gloo's all-gather receives into a flat buffer of its own and copies out of it: one whole
        # tensor more while it runs (measured: 2x the output); NCCL writes in place
        flat = 1 if dist.get_backend() == "gloo" else 0
        for name, t in self._sent():
            n = numel_of(t.shape)
            # the cast shard and the whole (and gloo's flat copy)
            with sink.scratch(n + n // world + flat * n) if sink else nullcontext():
                full = _gathered(t, dtype)  # cast first: half the bytes cross the wire
                if sink:
                    self._put(sink, name, full)
                del full  # freed before the next is gathered (no name of it outlives this block)

    def _put(self, sink: WeightSink, name: str, full: torch.Tensor) -> None:
        """The checkpoint tensors of one gathered tensor into ``sink``."""
        plain = self._hf_metas(name, full.shape) == [(name, tuple(full.shape))]
        converted = {name: full} if plain else checkpoint_names(self.model, {name: full})
        for hf_name, part in converted.items():
            sink.put(hf_name, part)

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Every weight the engines get, on rank 0 (tests; small models)."""
        dtype = next(self.model.parameters()).dtype
        sink = CollectSink(dtype)
        self.stream_weights(sink, dtype)
        return sink.weights

    def _tied(self) -> bool:
        return bool(getattr(self.model.config, "tie_word_embeddings", False))

    # -- checkpoints: every rank writes its own shards (trainer/shards.py) ------------------------------
    def _state(self, optimizer: bool) -> dict[str, Any]:
        """torch's sharded state dict: this rank's DTensor shards of the weights (and of the Adam
        state, keyed by parameter name), the views DCP writes from and loads into."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if not optimizer:
            return {"model": get_model_state_dict(self.model)}
        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optim}

    def save_checkpoint(self, path: str, async_save: bool) -> float:
        """This rank's shards into the DCP checkpoint at ``path``; the seconds this call blocked."""
        return self.writer.save(self._state(optimizer=True), path, async_save)

    def finish_checkpoint(self) -> float:
        return self.writer.wait()

    def load_checkpoint(self, path: str, weights_only: bool = False) -> None:
        """Weights (and Adam state) from a checkpoint written by any number of fsdp ranks."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_state_dict,
        )

        if not weights_only:
            self.store.create()
        state = self._state(optimizer=not weights_only)
        self.writer.load(state, path)
        # not strict: dcp.load has already failed on any key the checkpoint lacks; what strict would
        # add is a refusal of parameters that never had Adam state (a VLM's vision tower, trainable
        # but outside every text-only forward, so never stepped)
        opts = StateDictOptions(strict=False)
        if weights_only or self.store.active:
            # The optimizer's state dict holds its own state tensors, so dcp.load has filled them in
            # place, as kept (bf16, host memory); loading it into the optimizer would cast all of it
            # to fp32 on the GPU first.
            set_model_state_dict(self.model, state["model"], options=opts)
        else:
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optim"],
                options=opts,
            )


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torch's ``clip_grad_norm_`` over gradients on several meshes (expert parallelism puts the
    experts on a mesh of their own, and a norm cannot combine DTensors of two meshes): each mesh's
    norm whole, then the total of them; returns the norm before clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        by_mesh.setdefault(getattr(g, "device_mesh", None), []).append(g)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.tensor(0.0)
    coef = max_norm / (float(total) + 1e-6)  # torch's clip coefficient (a float: any mesh takes it)
    if coef < 1:
        for group in by_mesh.values():
            torch._foreach_mul_(group, coef)
    return total


def _cat_padded(parts: list[torch.Tensor]) -> torch.Tensor:
    width = max(p.shape[1] for p in parts)
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts], dim=0)


def _gathered(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The whole of a (possibly sharded) tensor, on every rank of its mesh: gathered in ``dtype``
    (on one rank, as it is: the sink casts as it copies)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t.detach()  # the sink casts as it copies
    if t.device_mesh.size() == 1:
        return t.to_local().detach()
    local: Any = t.detach().to(dtype)
    full = local.full_tensor()
    # gloo's worker keeps the finished all-gather (this input and its output with it) a moment
    # longer: wait, so that the next gather does not come on top of this one (sync/packer.py)
    let_go(local._local_tensor)
    return full
