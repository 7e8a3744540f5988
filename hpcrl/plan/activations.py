"""Training activations per GPU: bytes one layer keeps for its backward, by layer kind.

GPT layers (attention + MLP, optionally MoE) follow Korthikanti et al. 2022; hybrid (Nemotron-H)
layers are each one mixer behind a pre-norm and are counted here mixer by mixer. ``Share`` is one
GPU's slice of a micro-batch: ``tokens`` after context parallel, sequence-parallel tensors split by
``sp``, tensor-parallel ones by ``tp``, routed-expert ones over the expert-TP group.

Hybrid terms (bytes per token of ``tokens``; bf16 = 2 B, h hidden):
- every layer: the pre-norm's input and output, 4h / sp.
- Mamba-2 (``mamba_layer``), as hpcrl's torch mixer runs it (trainer/megatron/ssm.py: no mamba_ssm
  kernels here or on the lent GPU), all split by tp (heads and groups are): in_proj's bf16
  [z | x | B | C | dt] output, the conv1d output over [x | B | C] and its SiLU; the gated RMSNorm in
  fp32 (the scan's fp32 output y, 16 B of temporaries per channel measured, its fp32 output and
  out_proj's bf16 copy: 26 B per inner channel); and the chunked SSD scan, whose autograd-saved fp32
  tensors per head and token are 4p + 5n + 3Q + 2pn/Q elements (p head_dim, n state, Q chunk: x*dt,
  B and C repeated per head and B's decayed copy, the chunk's segment-sum / decay matrices, the
  chunk states; fitted over 9 shapes to 0.3%; transformers' ``mamba2_chunk_scan`` keeps one more
  p-vector for D, tests/plan/test_memory_hybrid.py). For Super that is 5.6 kB per head and token, 721 kB
  per token per layer at tp=1 (176 h): the largest layer. mamba_ssm's fused kernel keeps far less
  (it recomputes the scan). Under CP, Megatron's MambaContextParallel swaps the sequence split for
  a head split (heads / (tp x cp) over the whole sequence): the same bytes per GPU.
- attention (``*``, no MLP in the layer): Q and output over tp, K and V over min(tp, KV heads)
  (replicated beyond), gathered over the CP group (hpcrl's CP attention all-gathers K/V).
- LatentMoE (``E``): the router's logits and scores in the router dtype over the experts; the latent
  down-projection's output; per routed (token, expert) pair 4 latent-width vectors (dispatch send and
  receive buffers, expert output, combine) plus the expert's fc1 output and activation split by
  expert TP; each GPU holds tokens / sp x top-k x expert_tp pairs (balanced routing: a skewed router
  puts more on the busiest expert's GPU); the shared expert at the full hidden width over tp.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcrl.config.model import ModelConfig

BF16 = 2
FP32 = 4
ROUTER_BYTES = {"fp32": 4, "fp64": 8}
GATED_NORM_BYTES = 26
"""Per inner channel and token: y (fp32), the norm's fp32 temporaries (16), its fp32 output, out_proj's bf16 copy."""


@dataclass(frozen=True)
class Share:
    tokens: float
    """Tokens of one micro-batch on this GPU (micro_batch_size x sequence / cp)."""
    tp: int = 1
    sp: int = 1
    """tp with sequence parallel, else 1 (norm inputs and residuals stay whole on each TP rank)."""
    cp: int = 1
    expert_tp: int = 1
    router_bytes: int = BF16


def gpt_layer(model: ModelConfig, s: Share) -> float:
    """Korthikanti et al. 2022 (flash attention): 34 h per token, 24 h of it split by tp, 10 h by sp;
    plus, for MoE layers, the routed experts' inputs and hidden activations."""
    h = model.hidden_size
    full = h * s.tokens * (24 / s.tp + 10 / s.sp)
    if model.is_moe:
        width = model.moe_latent_size or h
        full += s.tokens * model.experts_per_token * (width + 2 * model.moe_ffn_hidden_size) * 2 / s.tp
    return full


def mamba_layer(model: ModelConfig, s: Share) -> float:
    hy = model.hybrid
    inner = hy.mamba_heads * hy.mamba_head_dim
    conv = inner + 2 * hy.mamba_groups * hy.mamba_state
    in_proj = inner + conv + hy.mamba_heads
    bf16 = BF16 * (in_proj + 2 * conv) / s.tp
    gate = GATED_NORM_BYTES * inner / s.tp
    return s.tokens * (_norm(model, s) + bf16 + gate + ssd_scan_bytes(model) / s.tp)


def ssd_scan_bytes(model: ModelConfig) -> float:
    """Autograd-saved bytes of the chunked SSD scan per token, all heads (module docstring)."""
    hy = model.hybrid
    p, n, q = hy.mamba_head_dim, hy.mamba_state, hy.mamba_chunk
    return FP32 * (4 * p + 5 * n + 3 * q + 2 * p * n / q) * hy.mamba_heads


def attention_layer(model: ModelConfig, s: Share) -> float:
    q = model.num_attention_heads * model.head_dim
    kv = 2 * model.num_kv_heads * model.head_dim / min(s.tp, model.num_kv_heads)
    return s.tokens * (_norm(model, s) + BF16 * (2 * q / s.tp + kv * s.cp))


def moe_layer(model: ModelConfig, s: Share) -> float:
    h, k = model.hidden_size, model.experts_per_token
    latent = model.moe_latent_size or h
    mlp = (3 if model.gated_mlp else 2) * model.moe_ffn_hidden_size / s.expert_tp
    pairs = k * s.expert_tp / s.sp  # routed (token, expert) pairs on this GPU per token of its share
    routed = pairs * BF16 * (4 * latent + mlp)
    router = 2 * s.router_bytes * model.num_experts / s.sp
    latent_proj = BF16 * latent / s.sp if model.moe_latent_size else 0
    shared = BF16 * (3 if model.gated_mlp else 2) * model.shared_expert_ffn / s.tp
    return s.tokens * (_norm(model, s) + router + latent_proj + routed + shared)


def dense_mlp_layer(model: ModelConfig, s: Share) -> float:
    mlp = (3 if model.gated_mlp else 2) * model.ffn_hidden_size
    return s.tokens * (_norm(model, s) + BF16 * mlp / s.tp)


def _norm(model: ModelConfig, s: Share) -> float:
    return 2 * BF16 * model.hidden_size / s.sp  # the pre-norm's input and output (= the mixer's input)


HYBRID_LAYERS = {"M": mamba_layer, "*": attention_layer, "E": moe_layer, "-": dense_mlp_layer}


def layer_bytes(model: ModelConfig, s: Share) -> dict[str, tuple[int, float]]:
    """Layer kind -> (layers of that kind, activation bytes of one of them on this GPU)."""
    if not model.is_hybrid:
        return {"layer": (model.num_layers, gpt_layer(model, s))}
    hy = model.hybrid
    counts = {"M": hy.mamba, "*": hy.attention, "E": hy.moe, "-": hy.mlp}
    return {kind: (n, HYBRID_LAYERS[kind](model, s)) for kind, n in counts.items() if n}


def activation_bytes(model: ModelConfig, s: Share, recompute: bool) -> float:
    """Without recompute every layer keeps its activations; with full recompute (one layer at a time)
    each keeps only its bf16 input, and the layer being recomputed the largest kind's activations."""
    layers = layer_bytes(model, s)
    if recompute:
        inputs = BF16 * model.hidden_size * s.tokens * model.num_layers / s.sp
        return inputs + max(one for _, one in layers.values())
    return sum(n * one for n, one in layers.values())
