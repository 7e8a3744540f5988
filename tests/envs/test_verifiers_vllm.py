"""A verifiers (0.4.0) environment played by the real vLLM engine (CPU build) through hpcrl's episodes:
``model=tiny_tools`` (warm-started to call a calculator, sometimes) on ``tests/harness/vf_taskset.py``'s
sums, whose toolset has the ``calculator`` tool it learned to call. Every episode's mask holds the
model's turns (1) and the tool's result (0) as the episode's renderer wrote it, its reward is the
taskset's rubric on what the model wrote, and no episode runs past ``env.max_turns``."""

from __future__ import annotations

import contextlib
import json

import pytest

from hpcrl.envs.builtin import calculate
from hpcrl.envs.config import EnvConfig
from hpcrl.envs.episodes import EpisodePrompt, Episodes, observation_renderer
from hpcrl.envs.pool import EnvPool
from hpcrl.envs.toolcall import ToolCall, ToolCallError, parse_tool_calls
from hpcrl.envs.verifiers_env import export_tasks, load_taskset
from hpcrl.rollout.base import SamplingSettings
from tests.conftest import compose

FACTORY = "tests.harness.vf_taskset:load"


def segments(ids: list[int], mask: list[int]) -> list[tuple[int, list[int]]]:
    """The episode's turns: (1 for the model's, 0 for the environment's, their ids)."""
    out: list[tuple[int, list[int]]] = []
    for i, m in zip(ids, mask, strict=True):
        if out and out[-1][0] == m:
            out[-1][1].append(i)
        else:
            out.append((m, [i]))
    return out


def parsed(turn: str) -> list[ToolCall]:
    """A turn's calls; none when it has none or they do not parse (an error turn, not the tool's)."""
    try:
        return parse_tool_calls(turn, "hermes")
    except ToolCallError:
        return []


@pytest.mark.slow
def test_vllm_plays_a_verifiers_environment(model_cache, tmp_path):
    from transformers import AutoTokenizer

    from hpcrl.rollout.vllm_engine import VLLMEngine
    from hpcrl.run.tiny_model import ensure_tiny_model

    # the recipe runs' seed: one build for this test and the recipe tests in one session
    model_dir = ensure_tiny_model(compose("model=tiny_tools").model, model_cache, seed=compose().run.seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = VLLMEngine(
        model_dir,
        compose().rollout,
        seed=0,
        max_model_len=64,
        on_cpu=True,
        scratch=tmp_path,
        kv_cache_gb=0.05,
    )
    export_tasks(load_taskset(FACTORY), tmp_path / "tasks.jsonl", limit=6)
    rows = [json.loads(line) for line in (tmp_path / "tasks.jsonl").read_text().splitlines()]
    cfg = EnvConfig(f"verifiers:{FACTORY}", max_turns=2, max_tokens=40, processes=12)
    observe = observation_renderer(tok)
    episodes = Episodes(engine, cfg, EnvPool(cfg, "exact"), observe)
    prompts = [
        EpisodePrompt([1, *tok.encode(r["prompt"], add_special_tokens=False)], r["prompt"], r["answer"])
        for r in rows
    ]
    settings = SamplingSettings(n=4, temperature=1.0, top_p=1.0, max_tokens=14, seed=7)
    groups = {i: g for part in episodes.generate_stream(prompts, settings) for i, g in part}
    assert sorted(groups) == list(range(6))
    called = checked = 0
    for i, group in groups.items():
        data = json.loads(rows[i]["answer"])
        for c in group:
            turns = segments(c.token_ids, c.mask)
            model_turns = [tok.decode(t, skip_special_tokens=True) for m, t in turns if m]
            assert turns[0][0] == 1, turns  # the episode opens with a model turn
            assert len(model_turns) >= 1, turns
            assert len(model_turns) <= cfg.max_turns, model_turns
            calls = parsed(model_turns[0])
            if calls and len(turns) > 1:
                called += 1
                result = None
                with contextlib.suppress(ValueError, KeyError):  # an expression the calculator refuses
                    result = str(calculate(calls[0].arguments["expression"]))
                if result is not None:
                    checked += 1
                    assert turns[1] == (0, observe(result))  # as the episode's renderer writes it
            right = model_turns[-1].strip() == str(data["a"] + data["b"])
            assert c.verdict is not None
            assert c.verdict[1] == pytest.approx(0.75 * right + 0.25 * any(map(parsed, model_turns))), (
                model_turns
            )
    assert called > 0  # some episodes took the tool's turn
    assert checked > 0  # and some tool results were compared with the calculator's
