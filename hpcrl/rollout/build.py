"""The engine ``rollout`` names, built in this process: the rollout actors and ``hpcrl eval`` share it."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def build_engine(
    model_dir: Path,
    rollout: Any,
    *,
    seed: int,
    max_model_len: int,
    on_cpu: bool,
    scratch: Path,
    kv_cache_gb: float | None,
) -> Any:
    """A ``VLLMEngine`` or an ``HFEngine``, as the rollout group chose (``kv_cache_gb``: vLLM on CPU only)."""
    from hpcrl.rollout.config import VLLMRolloutConfig

    if isinstance(rollout, VLLMRolloutConfig):
        from hpcrl.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(
            model_dir,
            rollout,
            seed=seed,
            max_model_len=max_model_len,
            on_cpu=on_cpu,
            scratch=scratch,
            kv_cache_gb=kv_cache_gb,
        )
    from hpcrl.rollout.hf_engine import HFEngine

    return HFEngine(model_dir, rollout, device="cpu" if on_cpu else "cuda")
