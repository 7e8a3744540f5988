"""Prompt templates by name (``data.template``): how a data set's problem becomes the prompt. A module
of its own, without the loader's imports, so that ``hpcrl plan`` can check the name cheaply."""

from __future__ import annotations

from hpcrl.errors import ConfigError

TEMPLATES = {
    "plain": "{problem}",
    "cot": "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}.",
    "dapo": (
        "Solve the following math problem step by step. The last line of your response should be of the "
        "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
        'Remember to put your answer on its own line after "Answer:".'
    ),
}


def render_prompt(template: str, problem: str) -> str:
    if template not in TEMPLATES:
        raise ConfigError(f"data.template='{template}' is unknown; use one of {', '.join(TEMPLATES)}")
    return TEMPLATES[template].format(problem=problem)
