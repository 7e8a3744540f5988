"""Data schema."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hpcrl.core.checks import MISSING, in_range, positive
from hpcrl.data.procedural import check_task, is_procedural, task_of
from hpcrl.errors import ConfigError

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
    """Record field holding the reference answer (e.g. ``reward_model.ground_truth``)."""
    answer_after: str | None = None
    """The reference answer is what follows the last occurrence of this marker in the answer field, where
    it occurs (GSM8K: ``####`` ends a worked solution); None: the whole field."""
    val_prompt_field: str | None = None
    """Field names of ``val_source`` when they differ from the training set's (None: the same)."""
    val_answer_field: str | None = None
    template: str = "cot"
    """Prompt template name (see hpcrl.data.templates)."""
    max_prompt_tokens: int = 1024
    verifier: str = "math"
    """Reward function by registry name."""
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
        if self.fewshot and self.template == "plain":
            raise ConfigError(
                "data.fewshot is shown as earlier chat turns, and data.template=plain prompts without the "
                "chat template: use another data.template or drop data.fewshot"
            )
        self.check_procedural()

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
