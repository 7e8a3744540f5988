"""Megatron model families: ``base.GPTFamily`` (the plain GPT's hooks), one module per family
(qwen: Qwen2/Qwen3/Llama, qwen3_moe, gemma3, gemma4) and ``table.FAMILIES``, which picks one per
checkpoint; table.py says how to add a family."""
