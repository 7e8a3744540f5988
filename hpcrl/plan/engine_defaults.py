"""Engine settings the plan decides where the config leaves them open, each with the line ``hpcrl
plan`` prints: the KV block size and the share of prompts that carry log-probs (vLLM on GPUs), which
engine generates how many sequences at once, with why (the measurements behind each), and how weights
reach the engines after a step (the refit mode the job's ``Fleet`` runs)."""

from __future__ import annotations

from typing import NamedTuple

from hpcrl.config.schema import RunConfig
from hpcrl.plan.topology import Placement, Topology, on_gpus
from hpcrl.rollout.backends import logprob_sampling, paged_kv, rollout_spec
from hpcrl.trainer.backends import trainer_spec

GPU_BLOCK_SIZE = 64
"""KV-cache block size of vLLM engines on GPUs where neither the config nor a quirk sets one. vLLM's
16 costs engine CPU per sequence and step that an RL batch (hundreds of sequences decoding together)
feels: on one H200 (GPU vLLM 0.26, Qwen2-1.5B shape, 256 x (128 + 256)) 64 took the step from 5.85 and
6.53 ms to 4.89 and 5.55 ms in two paired runs (+20%, +18% tokens/s; bench/results/README.md, session 14)."""
OWN_BLOCK_SIZE = {
    "nemotron_h": "hybrid Mamba: vLLM sizes attention blocks to align with the Mamba state itself",
    "gemma4": "512-wide global heads run on vLLM's Triton attention, not measured with 64",
}
"""Families whose engines keep vLLM's own block size, and why."""


def resolve_block_size(cfg: RunConfig) -> str:
    """Set ``rollout.block_size`` to GPU_BLOCK_SIZE in place where it is None on a vllm engine on GPUs
    (not for OWN_BLOCK_SIZE families); the line ``hpcrl plan`` prints, "" when nothing was chosen."""
    rollout = paged_kv(cfg.rollout)
    if (
        rollout is None  # no block size to choose
        or rollout.block_size is not None
        or not on_gpus(cfg.cluster)
        or cfg.model.family in OWN_BLOCK_SIZE
    ):
        return ""
    rollout.block_size = GPU_BLOCK_SIZE
    return f"rollout.block_size={GPU_BLOCK_SIZE} (auto: fewer KV blocks per sequence, less engine CPU a step)"


def engine_line(cfg: RunConfig) -> str:
    """The line ``hpcrl plan`` prints for the rollout engine on GPUs: which, how many sequences at
    once, and why (``RolloutSpec.why``); "" on CPUs."""
    rollout = cfg.rollout
    why = rollout_spec(rollout).why
    if not on_gpus(cfg.cluster) or not why:
        return ""
    return f"rollout={rollout.backend} max_num_seqs={rollout.max_num_seqs} ({why}; measured, bench sessions 18, 19, 23)"


SHARED_GPU_MAX_PARAMS = 0.5e9
"""Models up to this many active parameters get ``ENGINES_PER_SMALL_GPU`` vLLM engines on each rollout
GPU where ``rollout.engines_per_gpu`` is None: one engine of a small model is bound by its own host
process (scheduling, sampling, detokenizing), not by the GPU. Measured through ``hpcrl submit`` on one
H100 (GPU vLLM 0.26, colocated, sleep, CUDA-IPC refit; bench/results/README.md, session 20): at 135M
(SmolLM2, 512 samples a step) two engines took the rollout phase from 0.364 to 0.271 s (1.34x; step
1.385 -> 1.315 s); at 1.5B (256 x 256 tokens) from 1.574 to 1.974 s (0.80x). The bound sits between."""
ENGINES_PER_SMALL_GPU = 2


def resolve_engines_per_gpu(cfg: RunConfig) -> str:
    """Set ``rollout.engines_per_gpu`` in place where it is None: ``ENGINES_PER_SMALL_GPU`` for a vllm
    engine of tp 1 on GPUs serving at most ``SHARED_GPU_MAX_PARAMS``, else 1; the line ``hpcrl plan``
    prints for the shared GPUs, "" otherwise."""
    rollout = cfg.rollout
    if rollout.engines_per_gpu is not None:
        return ""
    params = cfg.model.param_counts().active
    shared = (
        rollout_spec(rollout).shares_gpu
        and rollout.tp == 1
        and on_gpus(cfg.cluster)
        and params <= SHARED_GPU_MAX_PARAMS
    )
    rollout.engines_per_gpu = ENGINES_PER_SMALL_GPU if shared else 1
    if not shared:
        return ""
    return (
        f"rollout.engines_per_gpu={ENGINES_PER_SMALL_GPU} (auto: {params / 1e9:.2g}B active parameters; up to "
        f"{SHARED_GPU_MAX_PARAMS / 1e9:.1f}B one engine is host-bound: two took the rollout 1.34x faster at "
        "135M, 0.80x at 1.5B, one H100, bench session 20)"
    )


LOGPROB_SAMPLE = 0.125
"""``rollout.logprob_fraction`` where no IS correction reads the engine's log-probs: only the
``gen_kl_error`` metric does (a refit gone wrong shows there), and a sample serves it. Asking for them
cost ~15 us of vLLM engine Python per sequence and step: 35% of the decode throughput on one H200
(Qwen2-1.5B shape, 256 sequences; bench/results/README.md, session 13)."""


def resolve_logprob_fraction(cfg: RunConfig) -> str:
    """Set ``rollout.logprob_fraction`` in place where it is None on an engine that samples log-probs:
    1 with an IS correction, LOGPROB_SAMPLE without; the line ``hpcrl plan`` prints for the sample, else ""."""
    rollout = logprob_sampling(cfg.rollout)
    if rollout is None or rollout.logprob_fraction is not None:
        return ""
    if not rollout.logprobs or cfg.algo.is_correction.value != "none":
        rollout.logprob_fraction = 1.0
        return ""
    rollout.logprob_fraction = LOGPROB_SAMPLE
    return (
        f"rollout.logprob_fraction={LOGPROB_SAMPLE} (auto: without an IS correction only gen_kl_error "
        "reads the engine's log-probs; a sample of prompts carries them)"
    )


class RefitChoice(NamedTuple):
    """How weights reach the engines after a step: ``mode`` (``run/refit.py``'s MODES) over a process
    group of ``backend``; the job's ``Fleet`` runs it as planned."""

    mode: str
    backend: str

    def line(self, requested: str) -> str:
        how = "explicit" if requested != "collective" else "auto"
        return f"refit={self.mode} over {self.backend} ({how}: rollout.weight_sync={requested})"


GLOO_BROADCAST = RefitChoice("broadcast", "gloo")
"""The refit on CPUs (and a plan's default)."""


def choose_refit(requested: str, *, on_cpu: bool, split: bool, ipc: bool) -> RefitChoice:
    """The refit for ``rollout.weight_sync``.

    ``collective`` on CPUs: a gloo broadcast. On GPUs: an NCCL broadcast when trainer and engines hold
    different GPUs (split placement); when they share them (colocated, or a local run on one GPU) two
    ranks of a group would sit on one device, which NCCL refuses, so each trainer rank hands the
    engine on its own GPU CUDA IPC handles (``ipc``: the same number of single-GPU engines on each trainer rank's GPU, and every
    rank able to stream the whole model — fsdp, or a single rank); else the object store."""
    if requested != "collective":
        return RefitChoice(requested, "gloo")
    if on_cpu:
        return GLOO_BROADCAST
    if split:
        return RefitChoice("broadcast", "nccl")
    return RefitChoice("ipc", "nccl") if ipc else RefitChoice("object_store", "nccl")


def resolve_refit(cfg: RunConfig, topo: Topology) -> RefitChoice:
    """The plan's refit: on GPUs the job starts the topology's ranks and engines as planned (on CPUs
    the mode does not depend on them)."""
    train, rollout = topo.train, topo.rollout
    whole_model = trainer_spec(cfg.trainer).ipc_any_world or train.world == 1
    whole_model = whole_model and rollout_spec(cfg.rollout).ipc_refit
    return choose_refit(
        cfg.rollout.weight_sync,
        on_cpu=not on_gpus(cfg.cluster),
        split=topo.placement is Placement.SPLIT,
        ipc=rollout.engines == train.world * rollout.per_gpu and rollout.tp == 1 and whole_model,
    )
