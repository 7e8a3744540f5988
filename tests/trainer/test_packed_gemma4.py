"""Packed rows on Gemma 4 (``trainer.packing``, fsdp backend) in the classes its recipes load: the
31B's and 26B-A4B's sliding and global layers (keys as values, attention both ways among image tokens
only: ``use_bidirectional_attention="vision"``), 26B-A4B's MoE block, E2B's per-layer embeddings, KV-shared
layers and double-wide MLPs, the 12B's unified checkpoint. The megatron backend's Gemma 4 packs in the
torchrun parity runs (tests/megatron/test_megatron_gemma.py)."""

from __future__ import annotations

import pytest

from tests.harness.tiny_checkpoints import Kinds, gemma4_model
from tests.trainer.test_packing import batch, packed_equals_padded

BASE = dict(family="gemma4", vlm=True, windowed=True, tied=True)
MODELS = {
    "31b": (Kinds(**BASE, keys_as_values=True), "vision"),
    "26b-a4b": (Kinds(**BASE, keys_as_values=True, moe=True), "vision"),
    "e2b": (Kinds(**BASE, per_layer=True, wide_mlp=True), None),
    "12b-unified": (Kinds(**BASE, keys_as_values=True, unified=True), "vision"),
}


@pytest.mark.parametrize("name", MODELS)
def test_packed_gemma4_forward_and_gradients_equal_the_padded_ones(name, monkeypatch):
    """The padded forward's log-probs, entropy and gradients at every target (sequences of 3 to 11
    tokens across 4-token windows), and no [L, L] mask built on the way: ``"vision"`` attends causally
    on a text row, so it takes the packed attention (it kept transformers' dense mask before). Each
    layer recomputed in the backward (``varlen.recompute_context``: KV-shared layers read their source
    layer's recomputed keys) gives the same gradients."""
    import torch

    from hpcrl.trainer.forward import packed_logprobs
    from hpcrl.trainer.varlen import recompute_context

    kinds, both_ways = MODELS[name]
    torch.manual_seed(0)
    model = gemma4_model(kinds).eval()
    # as the checkpoints' configs set it (read in the forward only: the layers are built the same)
    model.config.get_text_config().use_bidirectional_attention = both_ways
    b = batch([4, 9, 3, 6, 1], [5, 2, 8, 4, 2])
    _, _, kept = packed_equals_padded(model, b, monkeypatch)
    # the recipes recompute each layer in the backward (fsdp's trainer.activation_checkpointing); the
    # tiny configs have no dropout, so training mode changes nothing else
    model.train().gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": recompute_context}
    )
    model.zero_grad()
    logp, _ = packed_logprobs(model, b)
    (logp * b.loss_mask).sum().backward()
    for name, want in kept.items():
        assert torch.allclose(dict(model.named_parameters())[name].grad, want, atol=1e-6), name


def test_gemma4_packs_unless_it_attends_both_ways_everywhere():
    """``"all"`` (every token both ways) keeps transformers' SDPA and its mask; ``"vision"`` and None pack."""
    from types import SimpleNamespace

    from transformers import Gemma4TextConfig

    from hpcrl.trainer.varlen import use_packed_attention

    for both_ways, packs in (("all", False), ("vision", True), (None, True)):
        config = Gemma4TextConfig(num_hidden_layers=2, use_bidirectional_attention=both_ways)
        config._attn_implementation = "sdpa"
        assert use_packed_attention(SimpleNamespace(config=config)) == packs, both_ways
