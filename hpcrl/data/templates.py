"""Prompt templates by name (``data.template``): how a data set's problem becomes the prompt. The
templates themselves are the schema's (``data/config.py``: ``TEMPLATES``), where ``hpcrl plan`` checks
the name.

A problem that already carries the template's instruction is left as it is: DAPO-Math-17k's prompts are
DAPO's instruction around the problem, word for word the ``dapo`` template, and its validation set
(MATH-500) gets the same instruction from the template, once each."""

from __future__ import annotations

from hpcrl.data.config import TEMPLATES
from hpcrl.errors import ConfigError


def render_prompt(template: str, problem: str) -> str:
    if template not in TEMPLATES:
        raise ConfigError(f"data.template='{template}' is unknown; use one of {', '.join(TEMPLATES)}")
    before, after = TEMPLATES[template].format(problem="\0").split("\0")
    text = problem.strip()
    if (before.strip() or after.strip()) and text.startswith(before.strip()) and text.endswith(after.strip()):
        return problem  # the instruction is there already (DAPO-Math-17k's prompts)
    return before + problem + after


def fewshot_turns(fewshot: dict[str, str], template: str) -> list[dict[str, str]]:
    """``data.fewshot``'s solved problems as the earlier turns of a chat: each problem through
    ``template``, as the prompts are, then its reply."""
    return [
        turn
        for problem, reply in fewshot.items()
        for turn in (
            {"role": "user", "content": render_prompt(template, problem)},
            {"role": "assistant", "content": reply},
        )
    ]
