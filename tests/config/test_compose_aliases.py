"""Recipe names as the seeds type them, and the nearest names for a typo."""

from __future__ import annotations

import pytest

from hpcrl.config.compose import compose_config, normalize_overrides
from hpcrl.errors import ConfigError


@pytest.mark.parametrize(
    ("typed", "recipe"),
    [
        ("grpo-gemma3-1b-it-1n8g-fsdp2tp1-b200.yaml", "grpo-gemma3-1b-it-1n8g-fsdp2tp1"),
        ("grpo-gemma3-1b-it-1n8g-fsdp2tp1-b200", "grpo-gemma3-1b-it-1n8g-fsdp2tp1"),
        ("dapo-gemma4-12b-it-2n8g-fsdp2-automodel.yaml", "dapo-gemma4-12b-it-2n8g-fsdp2"),
        ("dapo-gemma4-26ba4b-it-4n8g-fsdp2ep16cp2-automodel", "dapo-gemma4-26ba4b-it-4n8g-fsdp2ep16cp2"),
        ("vlm_grpo-gemma4-e4b-geo3k-1n8g-automodel.yaml", "vlm_grpo-gemma4-e4b-it-1n8g-fsdp2"),
        ("grpo-tiny-1n1g-fsdp", "grpo-tiny-1n1g-fsdp"),
        ("no-such-recipe", "no-such-recipe"),
    ],
)
def test_the_seeds_recipe_names_mean_hpcrls(typed: str, recipe: str) -> None:
    assert normalize_overrides([f"+experiment={typed}"]) == [f"+experiment={recipe}"]


def test_an_unknown_name_suggests_the_nearest() -> None:
    with pytest.raises(ConfigError, match=r"unknown config 'model/qwen3_8'; did you mean qwen3_8b"):
        compose_config(["model=qwen3_8"])
    with pytest.raises(ConfigError, match=r"did you mean grpo-tiny-1n1g-fsdp\b"):
        compose_config(["+experiment=grpo-tiny-1n1g-fdsp"])
