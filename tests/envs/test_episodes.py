"""Multi-turn episodes on a real engine (the transformers engine on the tiny model, CPU) with real
environment processes: turns alternate until the environment ends the episode or a limit does; only
the model's tokens are in the loss mask and their log-probs are the engine's, in place; an environment
that hangs, crashes, raises, eats memory or grades out of range costs its own episode only."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hpcrl.envs.config import EnvConfig
from hpcrl.envs.episodes import EpisodePrompt, Episodes, observation_renderer
from hpcrl.envs.pool import EnvPool
from hpcrl.rewards.config import RewardsConfig
from hpcrl.rewards.pool import RewardPool, Task
from hpcrl.rewards.verifiers import Outcome, Verdict
from hpcrl.rollout.base import SamplingSettings
from hpcrl.trainer.batch import build_batch
from tests.conftest import compose

MODES = ["ok", "greet", "done", "hang", "crash", "raise", "eat", "bad_reward"]


@pytest.fixture(scope="module")
def played(tiny_dir):
    import os

    from transformers import AutoTokenizer

    from hpcrl.rollout.hf_engine import HFEngine

    os.environ["HPCRL_PLUGINS"] = "tests.harness.env_plugins"
    try:
        cfg = EnvConfig(
            "test_scripted", max_turns=3, max_tokens=60, processes=4, step_timeout_s=3, memory_mb=512
        )
        engine = HFEngine(tiny_dir, compose("model=tiny", "rollout=hf").rollout, device="cpu")
        tok = AutoTokenizer.from_pretrained(tiny_dir)
        observe = observation_renderer(tok)
        episodes = Episodes(engine, cfg, EnvPool(cfg, "exact"), observe)
        prompts = [EpisodePrompt(tok.encode(f"1 + {i} ="), f"1 + {i} =", m) for i, m in enumerate(MODES)]
        settings = SamplingSettings(n=2, temperature=1.0, top_p=1.0, max_tokens=5, seed=3)
        handed = list(episodes.generate_stream(prompts, settings))
        groups = {i: g for part in handed for i, g in part}
        return prompts, groups, observe, engine, len(handed)
    finally:
        del os.environ["HPCRL_PLUGINS"]


def test_every_group_comes_back_once_with_n_episodes(played):
    _prompts, groups, *_, parts = played
    assert sorted(groups) == list(range(len(MODES))) and all(len(g) == 2 for g in groups.values())
    assert parts > 1  # groups are handed over as their episodes end, not all at the end


def test_an_episode_alternates_model_and_environment_turns_until_max_turns(played):
    _prompts, groups, observe, *_ = played
    for c in groups[MODES.index("ok")]:
        assert len(c.token_ids) == len(c.mask) == len(c.logprobs)
        # three model turns (the limit), the environment's two observations between them, masked
        runs = [m for i, m in enumerate(c.mask) if i == 0 or c.mask[i - 1] != m]
        assert runs == [1, 0, 1, 0, 1]
        env_ids = [t for t, m in zip(c.token_ids, c.mask, strict=True) if m == 0]
        assert env_ids == observe("<obs 1>") + observe("<obs 2>")
        assert all(lp == 0.0 for lp, m in zip(c.logprobs, c.mask, strict=True) if m == 0)
        assert c.verdict == ("wrong", 0.25) and c.truncated  # ended by the turn limit
        assert "<obs 1>" in c.text and "<obs 2>" in c.text


def test_a_first_observation_comes_before_the_first_model_turn(played):
    _, groups, observe, *_ = played
    for c in groups[MODES.index("greet")]:
        first = observe("<start>")
        assert c.token_ids[: len(first)] == first and c.mask[: len(first)] == [0] * len(first)


def test_the_environment_ends_an_episode_with_its_grade(played):
    _, groups, *_ = played
    for c in groups[MODES.index("done")]:
        assert c.verdict == ("correct", 1.0) and set(c.mask) == {1} and not c.truncated


@pytest.mark.parametrize("mode", ["hang", "crash", "raise", "eat", "bad_reward"])
def test_a_broken_environment_costs_its_own_episode(played, mode):
    _, groups, *_ = played
    for c in groups[MODES.index(mode)]:
        assert c.verdict == ("error", 0.0)
        assert c.mask.count(0) == len(played[2]("<obs 1>"))  # it got through one step before breaking
        if mode != "bad_reward":
            assert "[environment error:" in c.text


def test_episodes_carry_their_share_of_the_environment_time(played):
    _, groups, *_ = played
    shares = [c.env_seconds for g in groups.values() for c in g]
    assert all(s > 0 for s in shares)  # every episode reset and stepped its environment
    # the hung environments held their rounds for env.step_timeout_s=3 before they were killed
    assert 3.0 <= sum(shares) < 30.0


def test_engine_logprobs_line_up_with_the_trained_tokens(played, tiny_dir):
    """Recomputed over the whole episode (prompt, model turns, observations), the model's log-prob of
    each masked-in token is the engine's: what the importance ratio and gen_kl_error compare."""
    from transformers import AutoModelForCausalLM

    prompts, groups, *_ = played
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    i = MODES.index("ok")
    for c in groups[i]:
        ids = torch.tensor([list(prompts[i]) + c.token_ids])
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        start = len(prompts[i]) - 1
        recomputed = lp[start:].gather(-1, ids[0, len(prompts[i]) :, None]).squeeze(-1)
        model_tokens = torch.tensor(c.mask, dtype=torch.bool)
        gap = (recomputed[model_tokens] - torch.tensor(c.logprobs)[model_tokens]).abs().max()
        assert gap < 1e-3


def test_the_batch_trains_on_model_tokens_only(played):
    prompts, groups, *_ = played
    i = MODES.index("ok")
    comps = groups[i]
    batch = build_batch(
        [list(prompts[i])] * 2,
        [c.token_ids for c in comps],
        [c.logprobs for c in comps],
        [1.0, -1.0],
        [1.0, 1.0],
        0,
        masks=[c.mask for c in comps],
    )
    p = len(prompts[i])
    for row, c in enumerate(comps):
        assert batch.loss_mask[row, p - 1 : p - 1 + len(c.mask)].tolist() == [float(m) for m in c.mask]
        assert batch.loss_mask[row].sum() == sum(c.mask)
    with pytest.raises(ValueError, match="a token mask of 1 for"):
        build_batch([[1]], [[2, 3]], [[]], [0.0], [1.0], 0, masks=[[1]])


def test_the_reward_pool_takes_an_environment_verdict_as_it_is():
    with RewardPool("exact", dataclasses.replace(RewardsConfig(), processes=1)) as pool:
        pool.submit([Task(0, "x", "x", "p"), Task(1, "x", "y", "p", verdict=("correct", 0.5))])
        got = pool.drain()
    assert got == {0: Verdict(Outcome.correct), 1: Verdict(Outcome.correct, 0.5)}


def test_a_turn_without_engine_logprobs_leaves_the_episode_without_any():
    from hpcrl.envs.episodes import Episode
    from hpcrl.rollout.base import Completion

    e = Episode([1, 2], session=None)  # type: ignore[arg-type]
    e.add_model(Completion([5, 6], [-0.5, -0.25], "ab", False, (3, 3)))
    e.add_env([7], "o", budget=10)
    e.add_model(Completion([8], [], "c", False, (4, 4)))  # rollout.logprob_fraction skipped this one
    c = e.completion()
    assert (c.token_ids, c.mask, c.logprobs, c.versions) == ([5, 6, 7, 8], [1, 1, 0, 1], [], (3, 4))
    e.add_env([9, 9, 9], "long", budget=6)  # past the budget: cut there, and the episode is over
    assert e.ids[-2:] == [9, 9] and e.done and e.truncated
