"""Qwen2, Qwen3 and Llama: Megatron's plain GPT (families/base.py) with Qwen2's Q/K/V biases and
Qwen3's Q/K norms; Transformer Engine's spec where it is installed."""

from __future__ import annotations

from typing import Any

from hpcrl.trainer.megatron.families.base import GPTFamily


class Llama(GPTFamily):
    """The plain GPT (Q/K/V biases where the config's ``attention_bias`` asks for them)."""

    model_types = ("llama",)


class Qwen2(GPTFamily):
    model_types = ("qwen2",)

    def config_fields(self, hf: Any) -> dict[str, Any]:
        # Hugging Face's Qwen2 attention always has Q/K/V biases; its config names none
        return {**super().config_fields(hf), "add_qkv_bias": True}


class Qwen3(GPTFamily):
    model_types = ("qwen3",)

    def config_fields(self, hf: Any) -> dict[str, Any]:
        return {**super().config_fields(hf), "qk_layernorm": True}
