"""Data schema."""

from __future__ import annotations

from dataclasses import dataclass

from hpcrl.config.checks import MISSING, in_range, positive
from hpcrl.errors import ConfigError


@dataclass
class DataConfig:
    name: str = MISSING
    source: str = MISSING
    """'synthetic' (built-in arithmetic task), a .jsonl/.parquet path, or 'hf:<dataset name>'."""
    split: str = "train"
    val_source: str | None = None
    """Validation set; None holds out ``val_fraction`` of the training source."""
    val_split: str = "test"
    val_fraction: float = 0.05
    max_val_samples: int = 256
    prompt_field: str = "problem"
    """Record field holding the problem (dotted for nested fields, e.g. ``prompt.0.content``)."""
    answer_field: str = "answer"
    """Record field holding the reference answer (e.g. ``reward_model.ground_truth``)."""
    val_prompt_field: str | None = None
    """Field names of ``val_source`` when they differ from the training set's (None: the same)."""
    val_answer_field: str | None = None
    template: str = "cot"
    """Prompt template name (see hpcrl.data.templates)."""
    max_prompt_tokens: int = 1024
    verifier: str = "math"
    """Reward function by registry name."""
    num_samples: int = 0
    """Synthetic task only: how many problems to generate (0 = default)."""
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
        ):
            raise ConfigError(
                f"data.source='{self.source}' must be 'synthetic', 'hf:<dataset>' or a .jsonl/.parquet file"
            )
