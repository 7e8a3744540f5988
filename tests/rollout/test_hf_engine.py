"""The hf rollout's static-cache decode path (GPU default) against the dynamic-cache loop, on CPU.

On GPUs the static path's decode step is ``torch.compile``d and replayed as a CUDA graph; here
compilation is replaced by the identity (the one GPU-only edge), so what is checked is the cache,
mask and position bookkeeping: the same greedy tokens and logprobs as the dynamic loop."""

from __future__ import annotations

import pytest
import torch

from hpcrl.rollout.base import SamplingSettings
from hpcrl.rollout.hf_engine import HFEngine
from tests.conftest import compose


def test_static_cache_path_matches_the_dynamic_loop(tiny_dir, monkeypatch):
    engine = HFEngine(tiny_dir, compose("model=tiny", "rollout=hf").rollout, device="cpu")
    engine.eos_id = -1  # decode every row to the end: 12 tokens each
    prompts = [[1, 5, 6, 7], [1, 8, 9], [1, 4, 4, 4, 4, 4, 4]]
    greedy = SamplingSettings(2, 0.0, 1.0, 12, 0)
    dynamic = engine.generate(prompts, greedy)
    monkeypatch.setattr(torch, "compile", lambda fn, **_: fn)
    monkeypatch.setattr(engine, "_use_static", lambda: True)
    static = engine.generate(prompts, greedy)
    again = engine.generate(prompts, greedy)  # the cached cache/mask are reset between calls
    assert list(engine._static) == [(6, 64 + 12)]  # prompt width rounded up to 64: one shape
    for run in (static, again):
        for group_d, group_s in zip(dynamic, run, strict=True):
            for d, s in zip(group_d, group_s, strict=True):
                assert s.token_ids == d.token_ids and len(d.token_ids) == 12
                assert s.logprobs == pytest.approx(d.logprobs, abs=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_gumbel_max_sampling_follows_softmax_over_temperature(temperature):
    from hpcrl.rollout.hf_engine import sample_tokens

    logits = torch.tensor([2.0, 1.0, 0.0, -1.0]).repeat(40000, 1)
    drawn = sample_tokens(logits, settings(temperature), torch.Generator().manual_seed(0))
    freq = torch.bincount(drawn, minlength=4).float() / len(drawn)
    expected = torch.softmax(logits[0] / temperature, dim=0)
    assert torch.allclose(freq, expected, atol=0.01), (freq, expected)
    assert torch.equal(sample_tokens(logits[:3], settings(0.0), None), torch.zeros(3, dtype=torch.long))


def settings(temperature: float = 1.0, **controls):  # type: ignore[no-untyped-def]
    from hpcrl.rollout.base import SamplingSettings

    return SamplingSettings(1, temperature, controls.pop("top_p", 1.0), 8, 0, **controls)


# probabilities 0.5, 0.25, 0.15, 0.06, 0.04 (temperature 1)
PROBS = torch.tensor([0.5, 0.25, 0.15, 0.06, 0.04])


@pytest.mark.parametrize(
    ("controls", "kept"),
    [
        ({"top_k": 2}, [0, 1]),
        ({"top_p": 0.7}, [0, 1]),  # 0.5 < 0.7 so the second stays; 0.75 >= 0.7 ends it there
        ({"top_p": 0.75}, [0, 1]),
        ({"top_p": 0.76}, [0, 1, 2]),
        ({"min_p": 0.25}, [0, 1, 2]),  # 0.06 < 0.25 x 0.5
        ({"top_k": 3, "top_p": 0.8}, [0, 1]),  # top_p over the top 3 renormalized: 0.56, 0.28, 0.17
        ({"top_p": 1e-6}, [0]),  # the most likely token always stays
    ],
)
def test_sampling_controls_keep_exactly_the_tokens_vllm_keeps(controls, kept):
    from hpcrl.rollout.hf_engine import sample_tokens

    logits = PROBS.log().repeat(20000, 1)
    drawn = sample_tokens(logits, settings(**controls), torch.Generator().manual_seed(0))
    assert sorted(set(drawn.tolist())) == kept
    freq = torch.bincount(drawn, minlength=5).float()[kept] / len(drawn)
    assert torch.allclose(freq, PROBS[kept] / PROBS[kept].sum(), atol=0.015)  # renormalized, not reshaped


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    from hpcrl.rollout.hf_engine import sample_tokens

    logits = torch.tensor([[2.0, 1.9, -0.5, -0.6]])
    seen = torch.tensor([[True, False, False, False]])
    assert sample_tokens(logits, settings(0.0), None, seen).item() == 0
    assert sample_tokens(logits, settings(0.0, repetition_penalty=1.1), None, seen).item() == 1  # 2/1.1 < 1.9
    negative = torch.tensor([[-0.5, -0.6, -3.0]])
    seen = torch.tensor([[True, False, False]])
    assert sample_tokens(negative, settings(0.0, repetition_penalty=1.3), None, seen).item() == 1  # -0.65


def test_decode_attention_equals_stock_sdpa_with_grouped_heads_and_padding():
    """One new token per row, 12 query heads over 2 KV heads, left-padded rows: the grouped-rows
    form gives stock SDPA's (repeat_kv) output."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from hpcrl.rollout.decode_attention import decode_sdpa_forward

    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 12, 1, 8, generator=g)
    k, v = torch.randn(3, 2, 10, 8, generator=g), torch.randn(3, 2, 10, 8, generator=g)
    mask = torch.ones(3, 1, 1, 10, dtype=torch.bool)
    mask[0, ..., :4] = False  # row 0: four pad positions on the left
    mask[2, ..., :1] = False
    module = SimpleNamespace(num_key_value_groups=6, is_causal=True)
    ours, _ = decode_sdpa_forward(module, q, k, v, mask, scaling=0.3)
    stock, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
    assert ours.shape == stock.shape == (3, 1, 12, 8)
    torch.testing.assert_close(ours, stock)
    shuffled, _ = decode_sdpa_forward(module, q[:, torch.randperm(12, generator=g)], k, v, mask, scaling=0.3)
    assert not torch.allclose(shuffled, stock)  # the head -> KV head assignment matters


def test_engine_decodes_with_the_grouped_attention(tiny_dir):
    engine = HFEngine(tiny_dir, compose("model=tiny", "rollout=hf").rollout, device="cpu")
    assert engine.model.config._attn_implementation == "hpcrl_sdpa"
    engine.eos_id = -1
    prompts = [[1, 5, 6, 7], [1, 8, 9]]
    greedy = SamplingSettings(1, 0.0, 1.0, 8, 0)
    ours = engine.generate(prompts, greedy)
    engine.model.set_attn_implementation("sdpa")
    stock = engine.generate(prompts, greedy)
    for a, b in zip(ours, stock, strict=True):
        assert a[0].token_ids == b[0].token_ids
        assert a[0].logprobs == pytest.approx(b[0].logprobs, abs=1e-5)


def test_moe_weights_travel_in_checkpoint_names_and_load_into_fused_experts(tmp_path):
    """The fsdp trainer exports checkpoint names (what vLLM and the megatron backend use), though
    transformers holds an MoE layer's experts fused; the hf engine fuses them back, and a name that
    matches nothing is an error instead of a silently stale weight."""
    from types import SimpleNamespace

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from hpcrl.trainer.fsdp import checkpoint_names

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_experts=3,
        num_experts_per_tok=2,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=False,
    )
    Qwen3MoeForCausalLM(config).save_pretrained(tmp_path)
    trained = AutoModelForCausalLM.from_pretrained(tmp_path)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p))  # a training step's worth of change
    sent = checkpoint_names(trained, trained.state_dict())
    assert sent.keys() == load_file(tmp_path / "model.safetensors").keys()  # per expert, as on disk
    assert "model.layers.0.mlp.experts.2.up_proj.weight" in sent

    engine = SimpleNamespace(model=AutoModelForCausalLM.from_pretrained(tmp_path))
    HFEngine.load_weights(engine, sent)  # type: ignore[arg-type]
    for name, value in trained.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], value), name
    with pytest.raises(KeyError, match="match no parameter"):
        HFEngine.load_weights(engine, {"model.layers.0.mlp.experts.0.gate_proj.bias": torch.zeros(16)})  # type: ignore[arg-type]
