"""SDPA attention for decoding with grouped-query heads, without copying the KV cache.

transformers' ``sdpa`` attention repeats every key/value head ``heads / kv_heads`` times whenever a
padding mask is present (SDPA's GQA support on CUDA refuses masks). A batched rollout always has one
(left-padded prompts), so each decode step of Qwen2-1.5B (12 query heads, 2 KV heads) wrote and read
six copies of the whole cache. For one new token the repeat is unnecessary: the query heads that
share a KV head become that head's query *rows* — ``[B, kv, groups, d]`` against ``[B, kv, S, d]`` —
and the ``[B, 1, 1, S]`` padding mask broadcasts over them. Prefill and everything else go to the
stock function.
"""

from __future__ import annotations

from typing import Any

NAME = "hpcrl_sdpa"


def decode_sdpa_forward(
    module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any
) -> Any:
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = int(getattr(module, "num_key_value_groups", 1))
    batch, heads, q_len, dim = query.shape
    if groups == 1 or q_len != 1 or attention_mask is None or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    # query head h uses KV head h // groups (repeat_kv's order), so a plain reshape groups them
    rows = query.reshape(batch, key.shape[1], groups, dim)
    out = torch.nn.functional.scaled_dot_product_attention(
        rows, key, value, attn_mask=attention_mask, scale=kwargs.get("scaling")
    )
    return out.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None


def register() -> str:
    """Make ``attn_implementation="hpcrl_sdpa"`` known to transformers (idempotent); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, decode_sdpa_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
