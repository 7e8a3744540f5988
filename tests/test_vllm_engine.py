"""The real vLLM engine (CPU build): generation logprobs and in-place weight reload match transformers."""

from __future__ import annotations

import pytest
import torch

from hpcrl.rollout.base import SamplingSettings

from .conftest import compose

pytestmark = pytest.mark.slow

PROMPTS = [[1, 5, 6, 14, 7, 18], [1, 9, 15, 6, 18]]


def hf_logprobs(model, prompt, completion):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    return lp[len(prompt) - 1 :].gather(-1, ids[0, len(prompt) :, None]).squeeze(-1)


def max_logprob_gap(engine, model):
    groups = engine.generate(PROMPTS, SamplingSettings(n=4, temperature=1.0, top_p=1.0, max_tokens=5, seed=0))
    assert [len(g) for g in groups] == [4, 4]
    gap = 0.0
    for prompt, group in zip(PROMPTS, groups, strict=True):
        for c in group:
            assert len(c.logprobs) == len(c.token_ids) > 0
            gap = max(
                gap, (hf_logprobs(model, prompt, c.token_ids) - torch.tensor(c.logprobs)).abs().max().item()
            )
    return gap


def engine_and_changed_model(model_dir, scratch):
    """A vLLM engine on ``model_dir`` (checked against transformers) and the transformers model with
    changed weights that the engine does not have yet."""
    from transformers import AutoModelForCausalLM

    from hpcrl.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(
        model_dir, compose().rollout, seed=0, max_model_len=32, on_cpu=True, scratch=scratch, kv_cache_gb=0.05
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert max_logprob_gap(engine, model) < 1e-4
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    assert max_logprob_gap(engine, model) > 1e-2  # the engine still has the old weights
    return engine, model


def test_reload_weights_in_place(tiny_dir, tmp_path):
    engine, model = engine_and_changed_model(tiny_dir, tmp_path)
    weights = dict(model.state_dict())
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]  # what the trainer sends for a tied head
    engine.load_weights(weights)
    assert max_logprob_gap(engine, model) < 1e-4


def test_gemma3_exported_through_the_megatron_mapping_reloads_into_vllm(tmp_path):
    """What trainer=megatron sends a Gemma 3 engine (to_hf of its Megatron weights: sandwich norms, Q/K
    norms, the tied head as lm_head) loads into vLLM's Gemma 3 in place: its logprobs then equal
    transformers' for the new weights (sliding window and two RoPE bases on the vLLM side too)."""
    from hpcrl.run.tiny_model import build_tokenizer
    from hpcrl.trainer.megatron.weights import Shape, to_hf, to_megatron

    from .test_megatron import gemma3_model

    model_dir = tmp_path / "gemma3"
    gemma3_model(head_dim=32).save_pretrained(model_dir)  # vLLM's CPU attention has no 16-wide heads
    build_tokenizer(model_dir, 128)
    engine, model = engine_and_changed_model(model_dir, tmp_path / "scratch")
    shape = Shape(heads=4, groups=2, head_dim=32, vocab=128, padded_vocab=128, sandwich_norms=True)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    engine.load_weights(to_hf(to_megatron(state, shape, tied=True), shape, tied=True))
    assert max_logprob_gap(engine, model) < 1e-4
