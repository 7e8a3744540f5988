"""What a command means where it leaves a choice open: the defaults the composer writes into the
command line before composing. Hydra and ``fastcompose`` both compose the rewritten overrides, so
the two paths cannot disagree about them, and ``hpcrl show`` prints what ``plan`` plans.

1. No cluster, model or recipe chosen: the embedded default recipe (the tiny model, this machine).
2. A cluster and a model but no recipe: the recipe marked as the default for that pair, if one is
   (``+cluster=gb200 +model=nemotron_super`` is the seed's DAPO + Megatron job on DAPO-Math-17k).
   The rest of the command line applies on top of it, as after ``+experiment=...``;
   ``+experiment=none`` opts out (the catalog's defaults for the pair, laid out automatically).
3. A real model (not a catalog model whose ``hf_id`` is ``local/...``) and no data set chosen by the
   command line or the recipe: ``data=dapo_math_17k``. The built-in synthetic task is for the tiny
   models alone (``preflight.check_synthetic`` refuses it with any other).

Where "this recipe is the job for this model on this cluster" lives: in the recipe, as a
``# @hpcrl default-recipe`` line. The model and cluster are the recipe's own ``override /model`` and
``override /cluster``, so the mark cannot contradict the job it sits in, and a site's recipe
(``$HPCRL_CONFIG_DIR/conf/experiment/``) joins with the same line and no code: it replaces
hpcrl's default for its pair. A table here would be one more file to keep in step with the recipes.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from hpcrl.config import fastcompose
from hpcrl.config.paths import conf_dirs
from hpcrl.config.preflight import local_in_catalog
from hpcrl.config.schema import GROUPS
from hpcrl.errors import ConfigError

EMBEDDED_DEFAULT = "grpo-tiny-1n1g-fsdp"
"""The recipe a bare command runs: no cluster, model or experiment chosen means this one."""

NO_RECIPE = "none"
"""``+experiment=none``: no recipe, not even the default one for the chosen model and cluster."""

DEFAULT_MARK = "# @hpcrl default-recipe"
"""A line of its own in a recipe: the recipe ``+cluster=C +model=M`` runs (C, M: the recipe's). It has
the form of Hydra's header lines (``# @KEY VALUE``), so Hydra reads it without complaint (and ignores
it) even among the header's ``# @package _global_``."""

REAL_DATA = "dapo_math_17k"
"""The data set of a real model whose command line and recipe choose none."""


def with_defaults(overrides: list[str]) -> list[str]:
    """``overrides`` with the defaults above written in (a recipe first, a data set last)."""
    chosen = _chosen(overrides)
    recipe = chosen.get("experiment")
    if recipe == NO_RECIPE:
        overrides = [item for item in overrides if _key(item) != "experiment"]
        recipe = None
    elif recipe is None:
        if not chosen.keys() & {"cluster", "model"}:
            return [f"+experiment={EMBEDDED_DEFAULT}", *overrides]
        recipe = default_recipes().get((chosen.get("model", ""), chosen.get("cluster", "")))
        if recipe is not None:
            overrides = [f"+experiment={recipe}", *overrides]
    if "data" in chosen:
        return overrides
    groups = recipe_groups(recipe) if recipe else {}
    if groups is None or "data" in groups:
        return overrides
    model = chosen.get("model") or groups.get("model")
    if model is None or local_in_catalog(model) is not False:  # the catalog's default model is tiny
        return overrides
    return [*overrides, f"data={REAL_DATA}"]


def _key(item: str) -> str:
    return item.lstrip("+").split("=", 1)[0]


def _chosen(overrides: list[str]) -> dict[str, str]:
    """Key -> value of the command line's assignments (the last one of a key wins, as in Hydra)."""
    return {_key(item): item.split("=", 1)[1] for item in overrides if "=" in item and item[0] != "~"}


def default_recipes() -> dict[tuple[str, str], str]:
    """(model, cluster) -> the recipe marked ``# @hpcrl default-recipe`` for the pair. The site's tree is read
    after hpcrl's, so a site's mark replaces hpcrl's; two marks for one pair in one tree are an error."""
    table: dict[tuple[str, str], str] = {}
    for root in conf_dirs():
        marked: dict[tuple[str, str], Path] = {}
        for path in sorted((root / "experiment").glob("*.yaml")):
            if DEFAULT_MARK not in (" ".join(line.split()) for line in path.read_text().splitlines()):
                continue
            groups = recipe_groups(path.stem) or {}
            pair = (groups.get("model", ""), groups.get("cluster", ""))
            if not all(pair):
                raise ConfigError(
                    f"{path}: '{DEFAULT_MARK}' makes it the default recipe of its model on its cluster, "
                    "but it does not choose both (defaults: - override /model: ..., - override /cluster: ...)"
                )
            if pair in marked:
                raise ConfigError(
                    f"{marked[pair]} and {path} are both '{DEFAULT_MARK}' for model={pair[0]} on "
                    f"cluster={pair[1]}; keep the line in one of them"
                )
            marked[pair] = path
        table.update({pair: path.stem for pair, path in marked.items()})
    return table


def recipe_groups(name: str) -> dict[str, str] | None:
    """The group options recipe ``name`` chooses, the recipes it builds on included (None: a recipe
    that only Hydra reads, or none of that name; composing it reports why)."""
    chosen = dict.fromkeys(GROUPS, "")
    try:
        fastcompose.read_recipe(conf_dirs(), name, chosen, seen=())
    except (fastcompose.Unsupported, OSError, yaml.YAMLError):
        return None
    return {group: option for group, option in chosen.items() if option}
