"""One home per setting: a file in ``conf/`` sets only what differs from where the setting already lives.

- A group file (``conf/<group>/<option>.yaml``) restates nothing its schema already defaults to; the
  trainer and rollout groups set nothing at all: their option picks a schema subclass
  (``FSDPTrainerConfig``, ``VLLMRolloutConfig``, ...), which holds that backend's defaults.
- A recipe (``conf/experiment/*.yaml``) restates nothing the groups and the recipes it builds on
  already give: a key it sets changes the run, or it is not there.
- The model catalog (``conf/model/*.yaml``) is exempt: it states the architecture, and a number that
  happens to equal a default (``tie_embeddings: false``) is still a fact of the checkpoint.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import pytest

from hpcrl.config import compose, fastcompose
from hpcrl.config.compose import conf_dir
from hpcrl.config.schema import GROUP_SCHEMAS, RunConfig

CONF = conf_dir()
SCHEMA_PER_OPTION = ("trainer", "rollout")
"""Groups whose options pick a schema subclass: the subclass is the home of the backend's defaults."""
EXEMPT = ("model", "experiment")
GROUP_FILES = sorted(
    p.relative_to(CONF).as_posix() for p in CONF.glob("*/*.yaml") if p.parent.name not in EXEMPT
)
RECIPES = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
_ABSENT = object()


def _body(path: Path) -> tuple[list[Any], dict[str, Any]]:
    _, body = fastcompose._load(path)  # the composer's own reading (YAML 1.2 floats such as 1e-6)
    return body.pop("defaults", []) or [], body


def _restated(body: dict[str, Any], current: object, prefix: str) -> list[str]:
    """The keys of ``body`` whose value equals what ``current`` (a config node) already holds."""
    out = []
    for key, value in body.items():
        name = f"{prefix}{key}"
        if isinstance(current, dict):
            have = current.get(key, _ABSENT)
        elif dataclasses.is_dataclass(current) and key in {f.name for f in dataclasses.fields(current)}:
            have = getattr(current, key)
        else:
            continue  # an unknown key: composition reports it (tests/config/test_config.py)
        if isinstance(value, dict) and (dataclasses.is_dataclass(have) or isinstance(have, dict)):
            out += _restated(value, have, f"{name}.")
        elif isinstance(value, bool) == isinstance(have, bool) and value == have:
            out.append(f"{name}: {value!r}")
    return out


def _schema(group: str, defaults: list[Any]) -> type:
    if group in SCHEMA_PER_OPTION:
        (name,) = [d for d in defaults if d != "_self_"]
        return GROUP_SCHEMAS[(group, name)]
    return typing.get_type_hints(RunConfig)[group]


@pytest.mark.parametrize("path", GROUP_FILES)
def test_group_files_do_not_restate_schema_defaults(path):
    group = path.split("/")[0]
    defaults, body = _body(CONF / path)
    schema = _schema(group, defaults)
    if group in SCHEMA_PER_OPTION:
        assert not body, (
            f"conf/{path} sets {sorted(body)}: a backend's defaults live in its schema "
            f"{schema.__name__} ({schema.__module__}); move them there"
        )
    restated = _restated(body, schema(), f"{group}.")
    assert not restated, (
        f"conf/{path} restates {schema.__name__}'s defaults ({', '.join(restated)}); delete those lines"
    )


def _without_body(recipe: str) -> RunConfig:
    """What recipe ``recipe`` would compose to without its own keys: its group choices, on top of
    the recipes it builds on (``+experiment=none``: not a model's default recipe for its cluster either)."""
    defaults, _ = _body(CONF / "experiment" / f"{recipe}.yaml")
    overrides = []
    for entry in defaults:
        if isinstance(entry, str) and entry != "_self_":
            overrides.append(f"+experiment={entry}")
        elif isinstance(entry, dict):
            ((key, option),) = entry.items()
            overrides.append(f"{key.removeprefix('override /')}={option}")
    if not any(item.startswith("+experiment=") for item in overrides):
        overrides.insert(0, "+experiment=none")
    return compose._compose_fast(overrides) or compose._compose_hydra(overrides)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipes_do_not_restate_what_their_groups_give(recipe):
    _, body = _body(CONF / "experiment" / f"{recipe}.yaml")
    restated = _restated(body, _without_body(recipe), "")
    assert not restated, (
        f"conf/experiment/{recipe}.yaml restates what its groups already give ({', '.join(restated)}); "
        "delete those lines"
    )


def test_the_checks_see_a_restatement():
    """The walk itself: nested keys, enum values as YAML strings, maps, lists, bools apart from ints."""
    found = _restated(
        {"tp": 1, "precision": "bfloat16", "freeze": [], "compile": None, "fused_logprob": 1},
        GROUP_SCHEMAS[("trainer", "fsdp_schema")](),
        "trainer.",
    )
    assert found == [
        "trainer.tp: 1",
        "trainer.precision: 'bfloat16'",
        "trainer.freeze: []",
        "trainer.compile: None",
    ]
    cluster = typing.get_type_hints(RunConfig)["cluster"]()
    assert _restated({"slurm": {"time": "04:00:00", "exclusive": False}}, cluster, "cluster.") == [
        "cluster.slurm.time: '04:00:00'"
    ]
