"""Data schema, and the names and record shapes its values are checked against: the prompt templates,
reasoning-gym's tasks and their options (``data.source=reasoning_gym:<task>``), a record's dotted field.

They sit here, below the data code that uses them (``loader``, ``templates``, ``procedural``), so that
the config layer checks ``data.*`` without importing the data layer: ``hpcrl plan`` refuses a name the
job would refuse. reasoning-gym is imported inside the functions: ``hpcrl plan`` never needs it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from hpcrl.core.checks import MISSING, in_range, positive
from hpcrl.errors import ConfigError
from hpcrl.rewards.config import PERCENT_READINGS, PERCENT_VERIFIERS

TEMPLATES = {
    "plain": "{problem}",
    "cot": "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}.",
    "dapo": (
        "Solve the following math problem step by step. The last line of your response should be of the "
        "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
        'Remember to put your answer on its own line after "Answer:".'
    ),
    # reasoning-gym's prompts ask for the final answer in tags; its verifier reads the last pair
    "answer_tags": "{problem}\nGive your final answer between <answer> and </answer> tags.",
    # an expression to complete, as the tiny models learned arithmetic ("7 + 9 =")
    "equals": "{problem} =",
}
"""Prompt templates by name (``data.template``); ``data/templates.py`` renders them."""
PREFIX = "reasoning_gym:"
"""``data.source`` of a procedural task: ``reasoning_gym:<task>`` (``data/procedural.py``)."""
SET_BY_HPCRL = {"seed": "run.seed", "size": "data.num_samples / data.max_val_samples"}
"""reasoning-gym task options hpcrl sets itself, from these keys."""

REASONING_GYM = "reasoning_gym"
"""The verifier of reasoning_gym sources (the task's own ``score_answer``)."""


@dataclass
class DataConfig:
    name: str = MISSING
    source: str = MISSING
    """'synthetic' (built-in arithmetic task), a .jsonl/.parquet path, 'hf:<dataset name>' or
    'reasoning_gym:<task>' (procedural, hpcrl/data/procedural.py)."""
    split: str = "train"
    val_source: str | None = None
    """Validation set; None holds out ``val_fraction`` of the training source."""
    val_split: str = "test"
    val_fraction: float = 0.05
    max_val_samples: int = 256
    prompt_field: str = "problem"
    """Record field holding the problem (dotted for nested fields, e.g. ``prompt.0.content``); for a
    reasoning_gym source, the entry's ``question`` or ``metadata.<key>``."""
    answer_field: str = "answer"
    image_field: str | None = None
    """Record field holding each prompt's images (geo3k: ``images``, a list of {bytes, path} as Hugging
    Face ``Image`` columns store them; a single image, or raw bytes, also do): they go through the
    model's processor to the engines and the trainer (``run/vision.py``). None: text only. A
    ``<image>`` marker in the problem text is dropped: the chat template places the images."""
    """Record field holding the reference answer (e.g. ``reward_model.ground_truth``)."""
    answer_after: str | None = None
    """The reference answer is what follows the last occurrence of this marker in the answer field, where
    it occurs (GSM8K: ``####`` ends a worked solution); None: the whole field."""
    val_prompt_field: str | None = None
    """Field names of ``val_source`` when they differ from the training set's (None: the same)."""
    val_answer_field: str | None = None
    template: str = "cot"
    """Prompt template: a name in ``TEMPLATES``, or a text file (a path ending in .txt, .jinja or .md;
    relative to the directory you submit in) whose text holds ``{problem}`` once, as the seeds'
    ``prompt_file``."""
    system_prompt: str | None = None
    """A system turn before every prompt (and before ``fewshot``), through the chat template."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables the model's chat template reads, e.g. ``{enable_thinking: false}`` (Qwen3)."""
    max_prompt_tokens: int = 1024
    verifier: str = "math"
    """Reward function by registry name."""
    percent: str | None = None
    """What a percent sign means in this data set's answers, for the math verifiers: ``number`` (it is
    a unit: ``12\\%`` equals ``12``, as MATH and GSM8K write the answers of "what percent" questions),
    ``fraction`` (``12\\%`` equals ``0.12`` and ``3/25``, not ``12``); None: math-verify's own reading,
    one-sided (a reference of ``12\\%`` takes ``12``, a reference of ``12`` refuses ``12\\%``, and neither
    equals ``0.12``)."""
    num_samples: int = 0
    """Generated sources (synthetic, reasoning_gym) only: how many training problems (0 = 4096)."""
    task_options: dict[str, Any] = field(default_factory=dict)
    """reasoning_gym sources only: the task's config fields, e.g. ``{min_terms: 2, max_digits: 1}``."""
    fewshot: dict[str, str] = field(default_factory=dict)
    """Solved problems shown before every prompt as earlier turns of the chat: problem -> the assistant's
    reply, in order (each problem through ``template``, as the prompts are). They show a small model the
    answer's form: SmolLM2-135M-Instruct tags half of its chain_sum answers after two, none without
    (bench/results/README.md, session 17). Needs the chat template (not ``template=plain``)."""
    check_source: bool = True
    """Check before submitting that a file ``source``/``val_source`` exists on the submitting machine
    (relative paths: from the directory you submit in); false for a path only the compute nodes see."""

    def check(self) -> None:
        positive("data.max_prompt_tokens", self.max_prompt_tokens)
        positive("data.max_val_samples", self.max_val_samples)
        in_range("data.val_fraction", self.val_fraction, 0.0, 0.5)
        if not (
            self.source == "synthetic"
            or self.source.startswith("hf:")
            or self.source.endswith((".jsonl", ".json", ".parquet"))
            or is_procedural(self.source)
        ):
            raise ConfigError(
                f"data.source='{self.source}' must be 'synthetic', 'hf:<dataset>', 'reasoning_gym:<task>' "
                "or a .jsonl/.parquet file"
            )
        chat_only = {
            "data.fewshot": self.fewshot,
            "data.system_prompt": self.system_prompt,
            "data.chat_template_kwargs": self.chat_template_kwargs,
        }
        for key, value in chat_only.items():
            if value and self.template == "plain":
                raise ConfigError(
                    f"{key} goes through the chat template, and data.template=plain prompts without it: "
                    f"use another data.template or drop {key}"
                )
        if self.image_field and (self.source == "synthetic" or is_procedural(self.source)):
            raise ConfigError(
                f"data.image_field={self.image_field}: data.source={self.source} has no images; drop "
                "data.image_field or read an image data set (a file or hf:<dataset>)"
            )
        if self.image_field and self.template == "plain":
            raise ConfigError(
                f"data.image_field={self.image_field}: images go into the prompt through the chat template, "
                "which data.template=plain leaves out; use another data.template"
            )
        self.check_procedural()
        self.check_percent()

    def check_percent(self) -> None:
        if self.percent is None:
            return
        if self.percent not in PERCENT_READINGS:
            raise ConfigError(
                f"data.percent={self.percent} must be one of {', '.join(PERCENT_READINGS)} (or null)"
            )
        if self.verifier not in PERCENT_VERIFIERS:
            raise ConfigError(
                f"data.percent rewrites answers for the {' and '.join(PERCENT_VERIFIERS)} verifiers; "
                f"data.verifier={self.verifier} reads its own: drop data.percent"
            )

    def check_procedural(self) -> None:
        """A reasoning_gym source generates its validation set and is scored by its own checker."""
        if not is_procedural(self.source):
            if self.verifier == REASONING_GYM:
                raise ConfigError(
                    f"data.verifier={REASONING_GYM} scores reasoning-gym problems only; data.source={self.source} "
                    "needs another verifier (math, exact, ...)"
                )
            if self.task_options:
                raise ConfigError(
                    f"data.task_options are for data.source=reasoning_gym:<task>, not {self.source}; drop them"
                )
            return
        if self.verifier != REASONING_GYM:
            raise ConfigError(
                f"data.source={self.source} is scored by the task's own checker: set data.verifier={REASONING_GYM} "
                f"(not {self.verifier})"
            )
        if self.val_source:
            raise ConfigError(
                f"data.val_source={self.val_source}: a reasoning_gym source generates its own validation set "
                "(another seed, no question in both); drop data.val_source"
            )
        check_task(task_of(self.source), self.task_options, self.prompt_field)


TEMPLATE_FILES = (".txt", ".jinja", ".md")
"""Endings of a ``data.template`` that names a file."""


def is_template_file(template: str) -> bool:
    return template.endswith(TEMPLATE_FILES)


def read_template(path: str) -> str:
    """A template file's text, checked: it exists and holds ``{problem}`` exactly once."""
    from pathlib import Path

    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(
            f"data.template={path}: no such file ({file.absolute()}); a relative path is from the "
            "directory you submit in"
        )
    text = file.read_text()
    if text.count("{problem}") != 1:
        raise ConfigError(
            f"data.template={path} must hold {{problem}} exactly once (where the problem goes); "
            f"it holds it {text.count('{problem}')} times"
        )
    return text


def is_procedural(source: str) -> bool:
    return source.startswith(PREFIX)


def task_of(source: str) -> str:
    return source[len(PREFIX) :]


def record_field(record: dict[str, Any], name: str, source: str) -> Any:
    """The field ``name`` of a data record (dotted for nested fields, a number indexes a list:
    ``prompt.0.content``), as ``data.prompt_field`` / ``data.answer_field`` name it."""
    node: Any = record
    for part in name.split("."):
        if isinstance(node, list) and part.isdigit():
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            raise ConfigError(
                f"{source}: records have no field '{name}' (set data.prompt_field / data.answer_field)"
            )
    return node


def gym() -> Any:
    """The reasoning_gym package, or a ConfigError saying how to install it."""
    try:
        import reasoning_gym
    except ImportError:
        raise ConfigError(
            "data.source=reasoning_gym:... needs the reasoning-gym package (pip install reasoning-gym==0.1.25; "
            "hpcrl's cpu and gpu extras have it)"
        ) from None
    return reasoning_gym


def check_task(task: str, options: dict[str, Any], prompt_field: str) -> None:
    """An unknown task, an unknown option, one the task's own config refuses, or a prompt field its
    entries lack: one ConfigError line. Skipped where reasoning-gym is not installed (a login node with
    hpcrl's light dependencies): the job checks the same when it generates the problems."""
    try:
        import reasoning_gym  # noqa: F401
    except ImportError:
        return
    check_task_options(task, options, prompt_field)


def check_task_options(task: str, options: dict[str, Any], prompt_field: str) -> None:
    """``check_task`` with reasoning-gym installed (the job's: ``procedural.generate``)."""
    datasets = gym().factory.DATASETS
    if task not in datasets:
        raise ConfigError(
            f"data.source={PREFIX}{task} is not a reasoning-gym task; use one of: {', '.join(sorted(datasets))}"
        )
    fields = sorted(f.name for f in dataclasses.fields(datasets[task][1]) if f.name not in SET_BY_HPCRL)
    for name in options:
        if name in SET_BY_HPCRL:
            raise ConfigError(f"data.task_options.{name} is set by hpcrl from {SET_BY_HPCRL[name]}; drop it")
        if name not in fields:
            raise ConfigError(
                f"data.task_options.{name} is not an option of reasoning-gym's {task}; its options: "
                f"{', '.join(fields)}"
            )
    try:
        entry = gym().create_dataset(task, seed=0, size=1, **options)[0]
    except (AssertionError, ValueError, TypeError) as exc:  # the task config's own validate()
        raise ConfigError(
            f"data.task_options={options} is refused by reasoning-gym's {task}: {exc or type(exc).__name__}"
        ) from None
    if entry_field(entry, prompt_field) is None:
        names = ["question", *(f"metadata.{k}" for k in entry.get("metadata", {}))]
        raise ConfigError(
            f"data.prompt_field={prompt_field} is not a field of reasoning-gym's {task} entries; use one of: "
            f"{', '.join(names)}"
        )


def entry_field(entry: dict[str, Any], path: str) -> str | None:
    """A reasoning-gym entry's field ``path`` (``question``, ``metadata.<key>``) as text; None where the
    entry lacks it or it is not a single value."""
    node: Any = entry
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return None if isinstance(node, dict | list) else str(node)
