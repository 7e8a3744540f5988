"""Trainer schemas, one per backend; the ``trainer`` config group picks one.

Parallel degrees live here and only here: the topology planner reads them, the backends read
the planner's ``TrainParallel``. Names follow Megatron's short forms (tp, pp, cp, ep).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, ClassVar

from hpcrl.core.checks import divisors, non_negative, positive
from hpcrl.core.parallel import TrainParallel
from hpcrl.errors import ConfigError

if TYPE_CHECKING:
    from hpcrl.config.model import ModelConfig

CHUNK_ELEMENTS = 1 << 28
"""Logit elements per chunk of ``trainer/logprob_head.py`` where its chunk math runs eagerly (CPU:
1 GiB fp32 temporaries each): 1766 tokens at a 152k vocabulary. Here, torch-free, for the planner."""
FUSED_CHUNK_ELEMENTS = 1 << 30
"""The same on GPUs, where the chunk math is compiled into kernels that read the bf16 logits once and
keep no fp32 copies: fewer, larger chunks (2 GiB of bf16 logits) mean fewer weight-gradient sums."""


class Precision(StrEnum):
    bfloat16 = "bfloat16"
    float32 = "float32"


class KernelChoice(StrEnum):
    auto, torch = "auto", "torch"


class Optimizer(StrEnum):
    adamw = "adamw"
    adafactor = "adafactor"


@dataclass
class TrainerConfig:
    backend: ClassVar[str]
    """The training backend, fixed by the schema class the ``trainer`` group picks (``trainer=fsdp``,
    ``trainer=megatron``): not a field, so no override can contradict the group."""
    tp: int = 1
    """Tensor parallel size."""
    pp: int = 1
    """Pipeline parallel size (Megatron only)."""
    cp: int = 1
    """Context parallel size: each sequence is split over this many GPUs."""
    ep: int = 1
    """Expert parallel size (MoE models): routed experts are split over this many GPUs."""
    micro_batch_size: int | None = 1
    """Sequences per forward/backward on one GPU. None: the planner picks the largest that fits
    (``plan/micro_batch.py``, with the line ``hpcrl plan`` prints)."""
    logprob_batch_size: int | None = None
    """Sequences per forward of the log-prob passes (the reference policy's, the old policy's with
    several minibatches): no backward, so often larger than ``micro_batch_size`` (seed 002's
    ``logprob_batch_size``). None: ``micro_batch_size``."""
    max_seq_len: int | None = None
    """Longest training sequence; None derives it from data.max_prompt_tokens + rollout.max_new_tokens
    (+ env.max_tokens instead, for multi-turn episodes)."""
    packing: bool = False
    """Cut micro-batches by tokens (``micro_batch_tokens``) instead of rows and run each as one row of
    whole sequences, positions restarting per sequence and attention kept inside each
    (``trainer/packing.py``): no compute on padding; Mamba layers restart at each sequence. The
    backends that pack say so in their table entry (``TrainerSpec.packs``, over CP ranks:
    ``packs_over_cp``). On in the long-tail DAPO recipes (2.58x real tokens/s at 1.5B, session 27)."""
    micro_batch_tokens: int | None = None
    """Token budget of a packed micro-batch (``packing``). None: ``micro_batch_size`` x the longest
    sequence: the tokens of the largest padded micro-batch. Packed rows hold about that many every
    time; with per-sequence attention (varlen) a 16,560-token budget at the 1.5B shape peaked at
    71.6 GB on one H100 against the padded step's 69.3 GB (under session 21's row mask it ran out of
    memory): lower this if a packed step runs out of memory."""
    precision: Precision = Precision.bfloat16
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward instead of keeping them (megatron:
    full recompute, one layer at a time)."""
    compile: bool | None = None
    """torch.compile each decoder layer (GPU only; CPUs run eagerly). ``None`` is the backend's measured
    choice (``compile_layers``): on for fsdp, where it took the Qwen2-1.5B GRPO step on one H200 from
    37.9k to 47.3k tokens/s (bench/results/README.md); the first step pays the compilation (~10 s).
    ``false`` if a model does not compile."""
    kernels: KernelChoice = KernelChoice.auto
    """Mamba-2 mixers: ``auto``, mamba_ssm / causal_conv1d where they run; ``torch`` (trainer/kernels.py)."""
    fused_logprob: bool = True
    """Log-probs straight from the final hidden states in chunks (``trainer/logprob_head.py``) instead
    of materialising the [tokens, vocab] logits: the same numbers, 40 GB less memory and 1.1x faster
    on the Qwen2-1.5B benchmark. (megatron: at tp=1; under TP the vocab-parallel loss is used.)"""
    grad_clip: float = 1.0
    optimizer: Optimizer = Optimizer.adamw
    """``adamw``, or ``adafactor`` (seed 003's optax.adafactor, as torch's ``Adafactor``): no first
    moment, the second moment of each matrix factored into its row and column means (state ~ rows +
    columns instead of 2 x its size); ``algo.lr`` caps its relative step size, scaled by each
    tensor's RMS. fsdp runs it on each rank's shard, the column and norm sums reduced over the shard
    group (trainer/fsdp/optim.py): the same update as on the whole tensor."""
    optimizer_dtype: Precision = Precision.float32
    """The dtype the optimizer's state (Adam's m and v, Adafactor's statistics) is kept in between
    steps. ``bfloat16`` halves it (seed 003's ``mu_dtype``); each step runs in fp32 on one tensor's
    state at a time and rounds back stochastically, so that updates smaller than bf16's precision
    (v's 0.1% a step at beta2=0.999) still land on average instead of never."""
    optimizer_offload: bool = False
    """Keep the optimizer's state in host memory (pinned) instead of on the GPU, and step one tensor at
    a time: its state copied in, stepped, copied back (seed 001's 12B recipe offloads its optimizer).
    The GPU then holds one tensor's state at most; the weights and gradients stay on the GPU (torch's
    ``CPUOffloadPolicy``, which moves them too and steps on the CPU, is not what this does). Costs
    two host transfers of the state per step; ``hpcrl plan`` counts the host memory per node."""
    weight_decay: float = 0.0
    """Decoupled weight decay (both optimizers)."""
    betas: list[float] | None = None
    """AdamW's (beta1, beta2): the decay rates of its gradient and squared-gradient averages; None:
    (0.9, 0.999). Adafactor has none (its beta2 grows with the step count)."""
    freeze: list[str] = field(default_factory=list)
    """Parameter-name prefixes kept frozen (vision/audio towers)."""
    router_dtype: str | None = None
    """MoE router precision; None keeps the model dtype (the MoE quirk sets fp32)."""
    moe_aux_loss_coeff: float | None = None
    """MoE load-balancing loss weight; None keeps the checkpoint's (the MoE quirk turns it off)."""
    router_replay: bool = False
    """MoE models (R3): the log-prob and training passes send each token to the experts the rollout
    engine's routers chose for it (``Completion.routes``), with the routing weights recomputed from
    the trainer's own router logits at those experts, so the router still gets its gradient
    (``trainer/router_replay.py``). Off, the trainer routes on its own, and numerics differences
    between engine and trainer send tokens to other experts (Megatron-LM#4168 saw 94% of tokens
    routed differently in at least one layer). The rollout engine records routes only when on."""
    mtp_loss_scale: float | None = None
    """A number: the model's multi-token-prediction layers (``model.mtp_layers``, the checkpoint's
    ``mtp.*``) are loaded, trained with their loss times this scale added to the policy loss (each MTP
    block predicts the token after next, on the loss tokens; logged as ``mtp_loss``), exported and sent
    with every refit, which ``rollout.speculative=mtp`` needs. NeMo RL's Nemotron 3 Super recipes use
    0.3 (Megatron's ``mtp_loss_scaling_factor``); 0 carries them untrained. None: the trainer leaves
    them out (the recipes' ``mtp_num_layers 0``)."""
    mtp_detach: bool = True
    """With ``trainer.mtp_loss_scale``: the MTP loss trains the MTP layers only (their inputs, the
    decoder's last hidden state and the embedding, and the shared head detached), so it never moves
    the policy; NeMo RL's production Super RL recipe does (``mtp_detach_heads``). False: it reaches the
    whole model, as in pretraining."""

    def parallel(self, world: int) -> TrainParallel:
        """These degrees as the record, for code that runs without a plan (torchrun harnesses, benches);
        the job's ranks take the plan's (``Fleet`` hands each ``plan.topology.train``)."""
        return TrainParallel(world=world, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep)

    def chunked_logprob(self, tp: int) -> bool:
        """Whether log-probs come from the chunked head (``trainer/logprob_head.py``) at tensor parallel
        ``tp`` (the plan's ``TrainParallel.tp``): read by the backend that builds it and by the memory
        estimate."""
        return self.fused_logprob

    def compile_layers(self) -> bool:
        """Whether the backend compiles its decoder layers on GPUs (``compile``, or the default)."""
        return True if self.compile is None else self.compile

    def micro_tokens(self, seq_len: int) -> int:
        """Tokens one micro-batch holds at most (the memory estimate's activations): the packing
        budget, or ``micro_batch_size`` rows of the longest sequence."""
        if self.packing and self.micro_batch_tokens is not None:
            return self.micro_batch_tokens
        return self.rows() * seq_len

    def rows(self) -> int:
        """``micro_batch_size``, which a plan has resolved where the config left it None."""
        if self.micro_batch_size is None:
            raise ConfigError(
                "trainer.micro_batch_size=null is chosen by the planner: plan the config first, or set a number"
            )
        return self.micro_batch_size

    def logprob_rows(self) -> int:
        """Sequences per forward of a log-prob pass."""
        return self.logprob_batch_size or self.rows()

    def adamw_betas(self) -> tuple[float, float]:
        b = self.betas or [0.9, 0.999]
        return b[0], b[1]

    def check(self) -> None:
        if self.logprob_batch_size is not None:
            positive("trainer.logprob_batch_size", self.logprob_batch_size)
        for key in ("tp", "pp", "cp", "ep"):
            positive(f"trainer.{key}", getattr(self, key))
        if self.micro_batch_size is not None:
            positive("trainer.micro_batch_size", self.micro_batch_size)
        if self.max_seq_len is not None:
            positive("trainer.max_seq_len", self.max_seq_len)
        if self.micro_batch_tokens is not None:
            positive("trainer.micro_batch_tokens", self.micro_batch_tokens)
            if not self.packing:
                raise ConfigError(
                    "trainer.micro_batch_tokens is the budget of a packed micro-batch: set "
                    "trainer.packing=true, or drop it (unpacked micro-batches hold trainer.micro_batch_size rows)"
                )
        positive("trainer.grad_clip", self.grad_clip)
        non_negative("trainer.weight_decay", self.weight_decay)
        if self.betas is not None and self.optimizer is Optimizer.adafactor:
            raise ConfigError(
                f"trainer.betas={self.betas} is AdamW's; trainer.optimizer=adafactor has no betas: drop trainer.betas"
            )
        if self.betas is not None and (len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas)):
            raise ConfigError(f"trainer.betas={self.betas} must be two numbers in [0, 1), e.g. [0.9, 0.999]")
        if self.moe_aux_loss_coeff is not None:
            non_negative("trainer.moe_aux_loss_coeff", self.moe_aux_loss_coeff)
        if self.mtp_loss_scale is not None:
            non_negative("trainer.mtp_loss_scale", self.mtp_loss_scale)
        elif not self.mtp_detach:
            raise ConfigError(
                "trainer.mtp_detach=false does nothing without trainer.mtp_loss_scale: set both or drop it"
            )


@dataclass
class FSDPTrainerConfig(TrainerConfig):
    """PyTorch FSDP2 (DTensor): parameters, gradients and optimizer state sharded over data parallel."""

    backend: ClassVar[str] = "fsdp"
    micro_batch_size: int | None = 4
    """Sequences per forward/backward on one GPU (fsdp's default; megatron's is 1; None: the planner's)."""
    reshard_after_forward: bool = True
    """Free each layer's gathered parameters after its forward and gather them again for the backward
    (ZeRO-3); false keeps them until the backward: one all-gather less per layer, more memory."""


MEGATRON_FAMILIES = ("qwen2", "qwen3", "llama", "qwen3_moe", "gemma3", "gemma4", "nemotron_h")
"""Model families (the catalog's ``family``) ``trainer=megatron`` builds: the keys of its family table
(hpcrl/trainer/megatron/families/table.py), named here without torch for the planner; a test keeps
the two equal. ``nemotron_h`` (Mamba-2 + attention + LatentMoE) trains without its MTP blocks;
``megatron_build_gap`` holds its parallelism limits."""


def fsdp_build_gap(model: ModelConfig, tp: int = 1, cp: int = 1, ep: int = 1) -> str:
    """Why ``trainer=fsdp`` cannot train this layout (empty: it can). Context parallel splits
    sequences over attention (trainer/context_parallel.py): layers that carry state along the
    sequence (Mamba) cannot be split that way."""
    if tp > 1:
        # It would run as plain data parallel over every GPU: right numbers, but not the memory
        # layout the plan assumes (weights and activations split over TP ranks).
        return (
            f"trainer=fsdp has no tensor parallelism yet (trainer.tp={tp}): set trainer.tp=1 (and "
            f"trainer.cp for long sequences), or use trainer=megatron (TP/PP/CP for "
            f"{', '.join(MEGATRON_FAMILIES)})"
        )
    if ep > 1 and (gap := _fsdp_ep_gap(model, ep)):
        return gap
    if cp > 1 and model.hybrid.mamba > 0:
        return (
            f"trainer=fsdp splits sequences over attention only, and {model.name} has Mamba layers: "
            f"set trainer.cp=1, or use trainer=megatron (its Mamba mixer splits heads under CP)"
        )
    return ""


FSDP_EP_FAMILIES = ("qwen3_moe", "gemma4")
"""Families whose experts ``trainer=fsdp`` splits over ``trainer.ep``: transformers holds them as gated
[gate; up] grouped tensors, the form its all-to-all dispatch runs (trainer/fsdp/expert_parallel.py);
Nemotron-H's experts are not gated."""


def _fsdp_ep_gap(model: ModelConfig, ep: int) -> str:
    """(That ep divides the experts, every backend's check, is planner.check_model_parallel's.)"""
    if model.family not in FSDP_EP_FAMILIES:
        return (
            f"trainer=fsdp splits the experts of {', '.join(FSDP_EP_FAMILIES)} over trainer.ep, not "
            f"{model.name}'s (family {model.family}): set trainer.ep=1, or use trainer=megatron"
        )
    return ""


def megatron_build_gap(model: ModelConfig, tp: int = 1, pp: int = 1, cp: int = 1) -> str:
    """Why ``trainer=megatron`` cannot build this catalog model at tensor / pipeline / context
    parallel ``tp`` / ``pp`` / ``cp`` yet (empty: it can). The backend refuses the same checkpoints
    by their Hugging Face fields (megatron/families/gemma4.py)."""
    if model.family not in MEGATRON_FAMILIES:
        return (
            f"trainer=megatron cannot build {model.name} yet (family {model.family}; the backend's "
            f"HF<->Megatron weight mapping covers {', '.join(MEGATRON_FAMILIES)})"
        )
    if model.family == "gemma4":
        return _gemma4_gap(model, tp)
    if model.family == "nemotron_h":
        return _nemotron_h_gap(model, tp, pp, cp)
    return ""


def _gemma4_gap(model: ModelConfig, tp: int) -> str:
    missing = [
        what
        for what, has in (
            ("per-layer embeddings and KV-shared layers (E2B/E4B)", model.per_layer_embed_dim > 0),
            ("gemma4_unified checkpoint", model.unified),
        )
        if has
    ]
    if missing:
        return (
            f"trainer=megatron cannot build {model.name} yet (it builds Gemma 4's 31B and 26B-A4B decoders, "
            f"not the {' or the '.join(missing)}): use trainer=fsdp, as the Gemma 4 recipes do"
        )
    if model.global_kv_heads and model.global_kv_heads % tp:
        # keys double as values there: each TP rank must hold whole KV heads
        return (
            f"trainer.tp={tp} must divide the {model.global_kv_heads} KV heads of {model.name}'s "
            f"global layers (model.global_kv_heads) under trainer=megatron"
        )
    return ""


def mamba_cp_splits(heads: int, groups: int, cp: int) -> bool:
    """Whether context parallel ``cp`` splits one TP rank's Mamba ``heads`` and ``groups`` as the
    mixer does (megatron/mamba_cp.py): whole heads per CP rank, groups split or repeated evenly."""
    return heads % cp == 0 and (groups % cp == 0 or cp % groups == 0)


def _nemotron_h_gap(model: ModelConfig, tp: int, pp: int, cp: int) -> str:
    """Megatron's hybrid stack: each TP rank runs whole Mamba heads and groups (the mixer's in_proj
    and conv1d split per [z, x, B, C, dt] part); KV heads are split while they go round, and once TP
    exceeds them each rank holds one KV head (TransformerConfig wants one to divide the other); the
    layer pattern is cut into ``pp`` equal stages (no virtual pipeline: Megatron-Bridge refuses it for
    hybrids). Under CP the mixer trades the sequence split for a head split (megatron/mamba_cp.py, as
    Megatron's MambaContextParallel): each CP rank scans the whole sequence for heads/(tp x cp) of the
    heads, and takes groups/(tp x cp) of the B/C groups, or, with fewer groups per TP rank than cp, a
    copy of the one its heads read; the gated norm runs back on the sequence split, whole groups."""
    h, name = model.hybrid, model.name
    for key, count in (("mamba_heads", h.mamba_heads), ("mamba_groups", h.mamba_groups)):
        if count % tp:
            options = ", ".join(str(d) for d in divisors(math.gcd(h.mamba_heads, h.mamba_groups)))
            return (
                f"trainer.tp={tp} must divide {name}'s {count} Mamba {key[6:]} (model.hybrid.{key}): "
                f"use trainer.tp in {options}"
            )
    kv = model.num_kv_heads
    if kv % tp and tp % kv:
        return f"trainer.tp={tp} must divide {name}'s {kv} KV heads or be a multiple of them"
    if model.num_layers % pp:
        return f"trainer.pp={pp} must divide {name}'s {model.num_layers} layers (pipeline stages split them evenly)"
    heads, groups = h.mamba_heads // tp, h.mamba_groups // tp
    if not mamba_cp_splits(heads, groups, cp):
        options = ", ".join(str(c) for c in divisors(heads) if mamba_cp_splits(heads, groups, c))
        return (
            f"trainer.tp={tp} x trainer.cp={cp} must divide {name}'s {h.mamba_heads} Mamba heads, and "
            f"trainer.cp must divide its {groups} Mamba groups per TP rank or be a multiple of them: "
            f"use trainer.cp in {options} at trainer.tp={tp}"
        )
    return ""


def megatron_family(model_type: str) -> str:
    """A Hugging Face text config's ``model_type`` -> the catalog family (Gemma 3's text decoder is
    ``gemma3_text``, in Gemma3ForCausalLM and inside Gemma3ForConditionalGeneration alike); each
    family class's ``model_types`` agree with it (tests/megatron/test_megatron_families.py)."""
    return {"gemma3_text": "gemma3", "gemma4_text": "gemma4"}.get(model_type, model_type)


@dataclass
class MegatronTrainerConfig(TrainerConfig):
    """Megatron-core: TP/PP/CP/EP model parallelism with the distributed optimizer."""

    backend: ClassVar[str] = "megatron"
    activation_checkpointing: bool = True
    """Full activation recompute by default: the large-model layouts megatron is for fit by it."""
    sequence_parallel: bool = True
    """With TP: activations outside attention/MLP split over the TP ranks (34/t instead of 10 + 24/t
    bytes per token x hidden per layer). Costs speed where memory is plentiful: Qwen2-1.5B at TP=2,
    8 x 2048 on 2 H200s ran 0.77x as fast for 0.91x the memory (bench/results/README.md)."""
    distributed_optimizer: bool = True
    """Adam's state sharded as Megatron's distributed optimizer (ZeRO-1): dense weights over data x
    context parallel, experts over their expert-data-parallel group; checkpoints keep each rank's shard."""
    expert_tp: int = 1
    """Tensor parallel size inside each expert (Megatron's expert_tensor_parallel_size): each expert's
    fc1/fc2 split over its own group, which Megatron carves out of the ranks like EP (ep x expert_tp
    divides one pipeline stage's GPUs); 1 keeps experts whole, spread by ``ep``."""

    def parallel(self, world: int) -> TrainParallel:
        return TrainParallel(world, self.tp, self.pp, self.cp, self.ep, self.expert_tp)

    def chunked_logprob(self, tp: int) -> bool:
        return self.fused_logprob and tp == 1  # under TP the vocab-parallel loss keeps logits split

    def moe_gap(self, model: str) -> str:
        """Why this layout cannot train the MoE model ``model`` yet (empty: it can)."""
        if self.tp > 1 and not self.sequence_parallel:
            # Megatron's MoE layer takes each TP rank's own slice of the tokens
            return (
                f"trainer=megatron runs MoE models ({model}) under tensor parallel with sequence parallel only "
                f"(trainer.tp={self.tp}): set trainer.sequence_parallel=true"
            )
        return ""

    def compile_layers(self) -> bool:
        """Default: compile unless tensor or context parallel (their collectives sit inside each layer).
        Measured on H200s, Qwen2-1.5B, 8 x 2048 (bench/results/README.md): compiled layers took one GPU
        from 38.5k to 43.2k tokens/s and PP=2 from 36.1k to 49.0k, but TP=2 from 58.7k down to 51.1k.
        Compiled TP=2, PP=2 and CP=2 match TP=1 to 2e-8 (bench/multi_gpu.py)."""
        return self.tp == 1 and self.cp == 1 if self.compile is None else self.compile

    def check(self) -> None:
        super().check()
        positive("trainer.expert_tp", self.expert_tp)
