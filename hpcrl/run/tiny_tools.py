"""``model=tiny_tools``: the tiny model (``run/tiny_model.py``'s network) warm-started to use a calculator.

The character vocabulary of ``tiny`` cannot write a tool call (no ``<``, ``{`` or ``"``, and a Hermes call
spelt out is ~80 characters, past the model's 64 positions). ``tiny_tools`` adds the newline its
observations are written with (``envs/episodes.py``: a template-less tokenizer's observation is the text
on its own lines) and the Hermes call's scaffold as whole tokens, as real tokenizers hold ``<tool_call>``
as one token: a call is ``<tool_call>`` ``{"name": "calculator", "arguments": {"expression": "`` the
expression ``"}}`` ``</tool_call>``, about a dozen tokens, which ``envs/toolcall.py`` parses like any.

Its warm start imitates an imperfect teacher on two-digit sums and differences, written as the calculator
recipe prompts them (reasoning-gym's ``basic_arithmetic`` expression, ``"47 + 85 ="``), in the episode's
exact token layout (prompt; model turn + EOS; observation; model turn + EOS; only model turns trained):
some traces call the calculator with the expression and answer with its result, some call it with a
miscopied expression (and answer with that wrong result), most answer directly, mostly wrongly. RL on the
multi-turn calculator task then has something to find: calling the tool and copying exactly pays.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcrl.envs.builtin import calculate

TOOLS_HF_ID = "local/hpcrl-tiny-tools"
"""``model.hf_id`` of the catalog's ``tiny_tools`` entry (``conf/model/tiny_tools.yaml``)."""
CALL_OPEN, CALL_HEAD, CALL_TAIL, CALL_CLOSE = (
    "<tool_call>",
    '{"name": "calculator", "arguments": {"expression": "',
    '"}}',
    "</tool_call>",
)
TOOL_TOKENS = ("\n", CALL_OPEN, CALL_HEAD, CALL_TAIL, CALL_CLOSE)
"""Whole tokens ``tiny_tools`` adds to the character vocabulary."""


@dataclass(frozen=True)
class ToolWarmStart:
    """The tool-use warm start (part of the cache key), in ``run/tiny_model.py``'s ``WarmStart`` terms."""

    steps: int
    lr: float
    bias_rate: float = 0.0
    call_share: float = 0.3
    """Traces that call the calculator; the rest answer directly."""
    miscopy_share: float = 0.25
    """Of the calls, those whose expression has one digit wrong."""
    direct_right: float = 0.2
    """Of the direct answers, those the teacher gets right (the others are off by 1 to 20)."""
    traces: int = 20000


TOOL_WARM_START = ToolWarmStart(steps=1200, lr=1e-3)


def uses_tools(model_cfg: Any) -> bool:
    return str(model_cfg.hf_id) == TOOLS_HF_ID


def tool_call(expression: str) -> str:
    return CALL_OPEN + CALL_HEAD + expression + CALL_TAIL + CALL_CLOSE


def teacher_trace(rng: random.Random, recipe: ToolWarmStart) -> tuple[str, list[tuple[bool, str]]]:
    """A prompt and its turns, (is the model's, text): the model's call, the calculator's result, the
    answer; or the answer alone."""
    a, b, op = rng.randint(10, 99), rng.randint(10, 99), rng.choice("+-")
    expression = f"{a} {op} {b}"
    value = a + b if op == "+" else a - b
    prompt = f"{expression} ="
    if rng.random() < recipe.call_share:
        if rng.random() < recipe.miscopy_share:
            i = rng.choice([k for k, ch in enumerate(expression) if ch.isdigit()])
            leading = i == 0 or not expression[i - 1].isdigit()  # no leading zero: "05" does not parse
            wrong = rng.choice([d for d in "0123456789"[leading:] if d != expression[i]])
            expression = expression[:i] + wrong + expression[i + 1 :]
        result = str(calculate(expression))  # what the calculator environment will answer
        return prompt, [(True, tool_call(expression)), (False, result), (True, result)]
    if rng.random() >= recipe.direct_right:
        value += rng.choice([-1, 1]) * rng.randint(1, 20)
    return prompt, [(True, str(value))]


def run_tokenizer(model: Any, model_dir: Path) -> Any:
    """The tokenizer as the run loads it (transformers' class for the model's type, as vLLM and the
    driver do; for Qwen2 it drops the spaces of ``"47 + 85 ="``): the traces are what the run will see."""
    from transformers import AutoTokenizer

    model.config.save_pretrained(model_dir)
    return AutoTokenizer.from_pretrained(model_dir)


def encode_traces(tok: Any, recipe: ToolWarmStart, seed: int) -> tuple[Any, Any]:
    """Token ids and loss mask (model turns and their EOS only) of the warm start's traces, laid out as
    an episode is: observations as ``envs/episodes.py``'s renderer writes them."""
    import torch

    from hpcrl.envs.episodes import observation_renderer

    observe = observation_renderer(tok)
    rng = random.Random(seed + 11)
    rows, masks = [], []
    for _ in range(recipe.traces):
        prompt, turns = teacher_trace(rng, recipe)
        ids = [tok.bos_token_id, *tok.encode(prompt, add_special_tokens=False)]
        mask = [0] * len(ids)
        for model, text in turns:
            part = [*tok.encode(text, add_special_tokens=False), tok.eos_token_id] if model else observe(text)
            ids += part
            mask += [int(model)] * len(part)
        rows.append(ids)
        masks.append(mask)
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    loss = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, (r, m) in enumerate(zip(rows, masks, strict=True)):
        out[i, : len(r)] = torch.tensor(r)
        loss[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    return out, loss
