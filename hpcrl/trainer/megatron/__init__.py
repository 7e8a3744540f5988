"""Megatron-core training backend (``trainer=megatron``).

compat.py   the one place that handles Megatron-core's hard CUDA calls on a CPU-only host
spec.py     TransformerConfig + layer spec (Transformer Engine when installed, else local + torch SDPA)
weights.py  Hugging Face <-> Megatron weight mapping (Qwen2/Qwen3/Llama, Qwen3-MoE, Gemma 3), TP/PP sharding
gemma.py    Gemma 3's decoder pieces (sandwich norms, sliding window, two RoPE bases, scaled embeddings)
optimizer.py AdamW with Megatron's distributed-optimizer sharding (dense over DP x CP, experts over expert DP)
trainer.py  the Trainer: logprobs, GRPO/DAPO loss through Megatron's pipeline schedules, export
"""

from hpcrl.trainer.megatron.trainer import MegatronTrainer

__all__ = ["MegatronTrainer"]
