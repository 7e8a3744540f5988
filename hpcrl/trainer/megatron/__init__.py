"""Megatron-core training backend (``trainer=megatron``). Floors, each importing only those below it:

trainer.py    the Trainer: the StepBackend of trainer/step.py (the step skeleton and the loss are shared
              with fsdp), logprobs, export, state
model.py      build checks, parallel state, GPTModel (or hybrid model) construction
load.py       this rank's part of the HF checkpoint, streamed in layer by layer (its stage, experts, TP slices)
pipeline.py   Megatron's pipeline schedule over micro-batches, token log-probs and entropy, CP split/join
grads.py      gradient finalize (DP/CP/expert reductions) and clipping
placement.py  which layers, experts and TP slices of the checkpoint this rank holds
optimizer.py  AdamW sharded as Megatron's distributed optimizer (dense over DP x CP, experts over expert DP)
spec.py       a checkpoint's family, TransformerConfig and layer spec (Transformer Engine when installed,
              else local + torch SDPA)
families/     the family table (table.py: how to add one), the plain GPT's hooks (base.py), one module
              per family: qwen (Qwen2/Qwen3/Llama), qwen3_moe, gemma3, gemma4, nemotron_h
gemma.py      modules Gemma 3 and 4 share (sandwich norms, GeGLU, sliding windows, two RoPE bases,
              scaled embeddings)
ssm.py        what the hybrid (Mamba) stack needs without mamba_ssm / Transformer Engine, and the
              hybrid model under either megatron-core version's names
experts.py    MoE experts as grouped GEMMs
attention.py  torch-SDPA core attention: sliding windows, context parallel
norms.py      the sequence-parallel RMSNorm every norm slot takes
spec_utils.py Megatron-core layer specs of both versions' shapes
weights.py    Hugging Face <-> Megatron weight mapping, TP/PP/EP sharding (weights_hybrid.py: Nemotron-H's)
compat.py     the one place that handles Megatron-core's hard CUDA calls on a CPU-only host
"""

from hpcrl.trainer.megatron.trainer import MegatronTrainer

__all__ = ["MegatronTrainer"]
