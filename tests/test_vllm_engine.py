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


def test_reload_weights_in_place(tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from hpcrl.rollout.vllm_engine import VLLMEngine

    cfg = compose()
    engine = VLLMEngine(tiny_dir, cfg.rollout, seed=0, max_model_len=32, on_cpu=True, scratch=tmp_path,
                        kv_cache_gb=0.05)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    assert max_logprob_gap(engine, model) < 1e-4

    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    assert max_logprob_gap(engine, model) > 1e-2  # the engine still has the old weights
    weights = dict(model.state_dict())
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]  # what the trainer sends for a tied head
    engine.load_weights(weights)
    assert max_logprob_gap(engine, model) < 1e-4
