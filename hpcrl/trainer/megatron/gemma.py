"""Megatron-core modules Gemma 3 and Gemma 4 share (their families: families/gemma3.py, gemma4.py).

- GeGLU with tanh-approximated GELU, Q/K norms, the softmax scale and the sliding windows from
  ``layer_types`` (``gemma_fields``: Megatron's ``window_size`` / ``window_attn_skip_freq``, applied by
  hpcrl's ``SDPAttention``);
- embeddings scaled by sqrt(hidden) — in the compute dtype, as Hugging Face and vLLM do (34.0, not
  33.94, in bf16 for the 1B): ``scale_embeddings``;
- two RoPE bases (global and sliding layers): ``DualRotaryEmbedding`` hands every layer both, stacked
  into one tensor (so Megatron's plumbing, recompute included, passes it unchanged),
  ``GemmaSelfAttention`` picks its own;
- "sandwich" norms on the attention and MLP outputs before each residual add: ``RowParallelLinearPostNorm``
  in the ``linear_proj`` / ``linear_fc2`` slots (weights ``linear_proj.post_layernorm``,
  ``linear_fc2.post_layernorm``, as Megatron-Bridge names them).

Imports Megatron-core, and no family.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import RowParallelLinear
from megatron.core.transformer.attention import SelfAttention

from hpcrl.trainer.megatron.attention import sliding_window
from hpcrl.trainer.megatron.norms import SPNorm


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``gelu_pytorch_tanh``."""
    return F.gelu(x, approximate="tanh")


def gemma_fields(hf: Any, softmax_scale: float) -> dict[str, Any]:
    """TransformerConfig fields Gemma 3 and 4 share: GeGLU (tanh GELU), Q/K norms, the softmax scale,
    and the sliding windows from ``layer_types`` (None where every layer is global)."""
    sliding = [int(kind == "sliding_attention") for kind in hf.layer_types]
    return {
        "activation_func": gelu_tanh,
        "bias_activation_fusion": False,  # Megatron fuses SwiGLU or erf-GELU only
        "qk_layernorm": True,
        "softmax_scale": softmax_scale,
        # Hugging Face: query i sees keys i - window + 1 .. i; Megatron's (left, right) counts them so
        "window_size": (hf.sliding_window - 1, 0) if any(sliding) else None,
        "window_attn_skip_freq": sliding if any(sliding) else None,
    }


def scale_embeddings(model: Any, hf: Any, compute_dtype: torch.dtype) -> None:
    """Embeddings times sqrt(hidden), the factor rounded to the compute dtype as HF and vLLM do."""
    if getattr(model, "embedding", None) is not None:  # the first pipeline stage
        factor = float(torch.tensor(hf.hidden_size**0.5, dtype=compute_dtype))
        model.embedding.register_forward_hook(lambda _module, _args, out: out * factor)


class DualRotaryEmbedding(torch.nn.Module):
    """GPTModel's rotary slot: [global, local] angles stacked, [2, s, 1, 1, head_dim] (Gemma 4: the
    global layers' head_dim; the local angles padded to it, each layer reads its own head_dim)."""

    def __init__(self, global_rope: Any, local_rope: Any) -> None:
        super().__init__()
        self.global_rope, self.local_rope = global_rope, local_rope

    def get_rotary_seq_len(self, *args: Any, **kwargs: Any) -> int:
        return int(self.global_rope.get_rotary_seq_len(*args, **kwargs))

    def forward(self, max_seq_len: int, **kwargs: Any) -> torch.Tensor:
        angles = self.global_rope(max_seq_len, **kwargs)
        local = self.local_rope(max_seq_len, **kwargs)
        return torch.stack([angles, F.pad(local, (0, angles.shape[-1] - local.shape[-1]))])


class GemmaSelfAttention(SelfAttention):
    """Megatron's SelfAttention taking its own RoPE angles (local on sliding layers) from the stack."""

    def __init__(self, config: Any, submodules: Any, layer_number: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        self.rope_index = int(sliding_window(config, self.layer_number) is not None)

    def forward(
        self, hidden_states: Any, attention_mask: Any, *args: Any, rotary_pos_emb: Any = None, **kwargs: Any
    ) -> Any:
        if rotary_pos_emb is not None:
            rotary_pos_emb = rotary_pos_emb[self.rope_index][..., : self.hidden_size_per_attention_head]
        return super().forward(hidden_states, attention_mask, *args, rotary_pos_emb=rotary_pos_emb, **kwargs)


class RowParallelLinearPostNorm(RowParallelLinear):
    """Megatron's RowParallelLinear followed by a norm of its output (Gemma's post-attention and
    post-MLP norms). Under sequence parallelism the output is this rank's slice of the sequence and
    the norm's weight gradient partial: ``SPNorm`` marks it to be summed over TP."""

    norm: type = SPNorm

    def __init__(self, input_size: int, output_size: int, *, config: Any, **kwargs: Any) -> None:
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.post_layernorm = self.norm(config, output_size, eps=config.layernorm_epsilon)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        out, bias = super().forward(x)
        assert bias is None, "Gemma 3 has no linear biases"
        return self.post_layernorm(out), None
