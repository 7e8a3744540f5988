"""Prompt templates (``data.template``): how a data set's problem becomes the prompt. The named
templates are the schema's (``data/config.py``: ``TEMPLATES``), where ``hpcrl plan`` checks the name; a
template may also be a text file, read once.

A problem that already carries the template's instruction is left as it is: DAPO-Math-17k's prompts are
DAPO's instruction around the problem, word for word the ``dapo`` template, and its validation set
(MATH-500) gets the same instruction from the template, once each."""

from __future__ import annotations

import functools

from hpcrl.data.config import TEMPLATES, DataConfig, is_template_file, read_template
from hpcrl.errors import ConfigError


def render_prompt(template: str, problem: str) -> str:
    before, after = template_parts(template)
    text = problem.strip()
    if (before.strip() or after.strip()) and text.startswith(before.strip()) and text.endswith(after.strip()):
        return problem  # the instruction is there already (DAPO-Math-17k's prompts)
    return before + problem + after


@functools.cache
def template_parts(template: str) -> tuple[str, str]:
    """The text before and after the problem: a named template's (``str.format`` escapes), or a file's,
    read once, whose only placeholder is ``{problem}`` (its other braces are text: LaTeX's, say)."""
    if is_template_file(template):
        before, after = read_template(template).split("{problem}")
        return before, after
    if template not in TEMPLATES:
        raise ConfigError(f"data.template='{template}' is unknown; use one of {', '.join(TEMPLATES)}")
    before, after = TEMPLATES[template].format(problem="\0").split("\0")
    return before, after


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


def earlier_turns(data: DataConfig) -> list[dict[str, str]]:
    """What comes before every prompt's user turn in the chat: ``data.system_prompt`` as a system turn,
    then ``data.fewshot``'s solved problems."""
    system = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    return [*system, *fewshot_turns(data.fewshot, data.template)]
