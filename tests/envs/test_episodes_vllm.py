"""Multi-turn episodes on the real vLLM engine (CPU build): each turn continues from the episode's
token ids, and the engine's log-probs of the model's tokens are the transformers model's over the
whole episode (prompt, turns, observations): the trained tokens and their log-probs line up. Issue 38
item 1: later turns find the episode's earlier tokens in the engine's prefix cache
(``rollout/prefix_cache_hit_rate`` > 0; their log-probs still line up), with KV blocks of 32 tokens (the
CPU build's smallest; its default, 128, is longer than these episodes) and prompts of 28, so no first
turn can find a whole block cached: the hits are later turns'."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hpcrl.envs.config import EnvConfig
from hpcrl.envs.episodes import EpisodePrompt, Episodes, observation_renderer
from hpcrl.envs.pool import EnvPool
from hpcrl.rollout.base import SamplingSettings
from tests.conftest import compose

BLOCK, PROMPT = 32, 28


@pytest.mark.slow
def test_vllm_episodes_keep_logprobs_aligned_across_turns(tiny_dir, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpcrl.rollout.vllm_engine import VLLMEngine

    monkeypatch.setenv("HPCRL_PLUGINS", "tests.harness.env_plugins")
    rollout = replace(compose().rollout, block_size=BLOCK)
    engine = VLLMEngine(
        tiny_dir, rollout, seed=0, max_model_len=64, on_cpu=True, scratch=tmp_path, kv_cache_gb=0.05
    )
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    cfg = EnvConfig("test_scripted", max_turns=3, max_tokens=48, processes=3)
    episodes = Episodes(engine, cfg, EnvPool(cfg, "exact"), observation_renderer(tok))
    asked = [tok.encode(f"{i} + 2 =") for i in range(2)]
    worked = tok.encode("3 + 4 = 7. " * 8)  # worked examples before the question: PROMPT tokens in all
    prompts = [EpisodePrompt(worked[: PROMPT - len(a)] + a, f"{i} + 2 =", "ok") for i, a in enumerate(asked)]
    assert [len(p) for p in prompts] == [PROMPT, PROMPT]
    settings = SamplingSettings(n=2, temperature=1.0, top_p=1.0, max_tokens=6, seed=5)
    groups = {i: g for part in episodes.generate_stream(prompts, settings) for i, g in part}
    assert episodes.stats()["rollout/prefix_cache_hit_rate"] > 0
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    model_turns = 0
    for i, group in groups.items():
        for c in group:
            ids = torch.tensor([list(prompts[i]) + c.token_ids])
            with torch.no_grad():
                lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1)
            p = len(prompts[i])
            recomputed = lp[p - 1 :].gather(-1, ids[0, p:, None]).squeeze(-1)
            mine = torch.tensor(c.mask, dtype=torch.bool)
            assert (recomputed[mine] - torch.tensor(c.logprobs)[mine]).abs().max() < 1e-4
            model_turns += sum(1 for j, m in enumerate(c.mask) if m and (j == 0 or not c.mask[j - 1]))
    assert model_turns == 2 * 2 * 3  # every episode took its three turns
