"""Compose ``conf/`` without Hydra for the plain cases, so a cold ``hpcrl plan`` stays under a second.

Importing Hydra and OmegaConf and composing costs ~0.6 s of a ~1 s cold start. Our tree uses a small,
fixed part of Hydra: a primary ``config.yaml`` whose defaults pick one option per group, group files
that name a schema in their defaults, ``+experiment=`` recipes in ``@package _global_`` that
``override /group: option``, and ``key=value`` overrides with plain scalars. This module does exactly
that and builds the typed dataclasses directly.

It never decides anything it is unsure of: whatever falls outside that subset (sweep or list syntax,
quotes, interpolations, deletions, a value whose type needs converting, an unknown key or option, a
required value left unset) makes ``compose`` return None and the caller composes with Hydra, which
then gives its own result or its one-line error. ``tests/config/test_fastcompose.py`` checks that both paths
give equal configs for every shipped recipe and a spread of overrides.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import re
import types
import typing
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from hpcrl.core.checks import MISSING


class Unsupported(Exception):
    """Outside the subset handled here: compose with Hydra instead."""


# YAML 1.2 floats such as ``1e-6`` (PyYAML alone reads them as strings; OmegaConf's loader does not).
_FLOAT_RE = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)


class _Loader(yaml.CSafeLoader if hasattr(yaml, "CSafeLoader") else yaml.SafeLoader):  # type: ignore[misc]
    pass


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_RE, list("-+0123456789."))


def yaml_loader() -> type:
    """The YAML loader of conf/ files (site.yaml too): PyYAML's, reading ``1e-6`` as OmegaConf does."""
    return _Loader


def _load(path: Path) -> tuple[str | None, dict[str, Any]]:
    """(package header, a fresh copy of the body) of one YAML file: callers merge into it."""
    package, body = _parse(path)
    return package, copy.deepcopy(body)


@cache
def _parse(path: Path) -> tuple[str | None, dict[str, Any]]:
    text = path.read_text()
    package = None
    for line in text.splitlines():
        if line.startswith("# @package"):
            package = line.split(None, 2)[2].strip()
    body = yaml.load(text, Loader=_Loader) or {}
    if not isinstance(body, dict):
        raise Unsupported(f"{path} is not a mapping")
    return package, body


# Command-line scalars: only forms whose meaning is the same in Hydra's override grammar.
_INT = re.compile(r"^[-+]?(0|[1-9][0-9]*)$")
_FLOAT = re.compile(r"^[-+]?(0|[1-9][0-9]*)(\.[0-9]+([eE][-+]?[0-9]+)?|[eE][-+]?[0-9]+)$")
_WORD = re.compile(r"^[A-Za-z_][A-Za-z0-9_./:@+-]*$")
# Several grammar tokens joined (``08:00:00``, ``registry/image:tag``) are a string to Hydra whatever
# they start with; no single number/bool/null token holds one of ``:/@``.
_JOINED = re.compile(r"^[A-Za-z0-9_./:@+-]*[:/@][A-Za-z0-9_./:@+-]*$")
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_NOT_WORDS = {"true", "false", "null", "inf", "nan"}


def parse_value(text: str) -> Any:
    if _INT.match(text):
        return int(text)
    if _FLOAT.match(text):
        return float(text)
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "null":
        return None
    if (_WORD.match(text) and low not in _NOT_WORDS) or _JOINED.match(text):
        return text
    raise Unsupported(f"value {text!r}")


def _merge(into: dict[str, Any], new: dict[str, Any]) -> None:
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _split_defaults(body: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    body = dict(body)
    return body.pop("defaults", []) or [], body


Roots = Path | tuple[Path, ...]
"""One ``conf/`` tree, or several searched in order (hpcrl's, then the site's)."""

SiteValues = Callable[[str], list[tuple[str, Any]]]
"""The chosen cluster option -> (dotted key, value) pairs applied over the recipes (the site keys the
command line does not set)."""


def compose(
    conf_dir: Roots, overrides: list[str], schemas: dict[tuple[str, str], type], root: type
) -> Any | None:
    """The typed config for ``overrides`` (already normalised), or None when Hydra must do it."""
    composed = compose_with_choices(conf_dir, overrides, schemas, root)
    return composed[0] if composed else None


def compose_with_choices(
    conf_dir: Roots,
    overrides: list[str],
    schemas: dict[tuple[str, str], type],
    root: type,
    site: SiteValues | None = None,
) -> tuple[Any, dict[str, str]] | None:
    """(typed config, the option chosen in each group), or None when Hydra must do it."""
    roots = conf_dir if isinstance(conf_dir, tuple) else (conf_dir,)
    try:
        return _compose(roots, overrides, schemas, root, site)
    except (Unsupported, OSError, yaml.YAMLError):
        return None


def _compose(
    roots: tuple[Path, ...],
    overrides: list[str],
    schemas: dict[tuple[str, str], type],
    root: type,
    site: SiteValues | None,
) -> tuple[Any, dict[str, str]]:
    selected, order, primary_body = _primary(roots[0])
    group_cli, experiments, values = _parse_overrides(overrides, selected)
    experiment_body: dict[str, Any] = {}
    for name in experiments:
        experiment_body = read_recipe(roots, name, selected, seen=())
    selected.update(group_cli)  # the command line wins over a recipe's overrides, as in Hydra

    merged: dict[str, Any] = {}
    chosen_schema: dict[str, type] = {}
    for group in order:
        body, schema = _group(roots, group, selected[group], schemas)
        if schema is not None:
            chosen_schema[group] = schema
        _merge(merged.setdefault(group, {}), body)
    _merge(merged, primary_body)
    _merge(merged, experiment_body)
    for path, value, appended in values:
        _set_value(merged, path, value, appended, _ends_in_map(root, chosen_schema, path))
    for dotted, value in site(selected["cluster"]) if site else ():
        *parents, leaf = dotted.split(".")
        node = merged
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = copy.deepcopy(value)
    return build(root, merged, chosen_schema), selected


def find(roots: tuple[Path, ...], relative: str) -> Path:
    """The first ``relative`` file under ``roots`` (Unsupported: none has it; Hydra names the options)."""
    for base in roots:
        if (base / relative).is_file():
            return base / relative
    raise Unsupported(f"no {relative}")


def _primary(conf_dir: Path) -> tuple[dict[str, str], list[str], dict[str, Any]]:
    """``config.yaml``: the option each group defaults to, the groups in order, and its own body."""
    primary_defaults, primary_body = _split_defaults(_load(conf_dir / "config.yaml")[1])
    selected: dict[str, str] = {}
    order: list[str] = []
    for entry in primary_defaults:
        if entry in ("_self_", "hpcrl_schema"):
            continue
        if not isinstance(entry, dict) or len(entry) != 1:
            raise Unsupported(f"defaults entry {entry!r}")
        ((key, option),) = entry.items()
        if key.startswith("override hydra/"):
            continue
        if "/" in key or " " in key:
            raise Unsupported(f"defaults entry {entry!r}")
        selected[key] = option
        order.append(key)
    return selected, order, primary_body


def _parse_overrides(
    overrides: list[str], groups: dict[str, str]
) -> tuple[dict[str, str], list[str], list[tuple[list[str], Any, bool]]]:
    """(group choices, experiments, (dotted path, value, ``+``-appended) assignments) of the command line."""
    group_cli: dict[str, str] = {}
    experiments: list[str] = []
    values: list[tuple[list[str], Any, bool]] = []
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or key.startswith("++") or key.startswith("~"):
            raise Unsupported(item)
        appended = key.startswith("+")
        key = key.lstrip("+")
        if key == "experiment":
            experiments.append(text)
        elif key in groups:
            if appended:
                raise Unsupported(item)
            group_cli[key] = text
        elif "." in key and all(_KEY.match(part) for part in key.split(".")):
            values.append((key.split("."), parse_value(text), appended))
        else:
            raise Unsupported(item)
    if len(experiments) > 1:
        raise Unsupported("several experiments")
    return group_cli, experiments, values


def _group(
    roots: tuple[Path, ...], group: str, option: str, schemas: dict[tuple[str, str], type]
) -> tuple[dict[str, Any], type | None]:
    """The body of ``<group>/<option>.yaml`` and the schema its defaults name (None: the root's type)."""
    package, body = _load(find(roots, f"{group}/{option}.yaml"))
    if package is not None:
        raise Unsupported(f"{group}/{option} has a @package header")
    group_defaults, body = _split_defaults(body)
    chosen = None
    for entry in group_defaults:
        if entry == "_self_":
            continue
        chosen = schemas.get((group, entry)) if isinstance(entry, str) else None
        if chosen is None:
            raise Unsupported(f"{group} defaults entry {entry!r}")
    return body, chosen


def _set_value(merged: dict[str, Any], path: list[str], value: Any, appended: bool, into_map: bool) -> None:
    node = merged
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise Unsupported(".".join(path))
    # Hydra: ``+key`` only adds a map entry that is not there yet; a bare key must exist.
    if (into_map and appended == (path[-1] in node)) or (appended and not into_map):
        raise Unsupported(".".join(path))
    node[path[-1]] = value


def _ends_in_map(root: type, chosen: dict[str, type], path: list[str]) -> bool:
    """Whether ``path`` names an entry of a dict-typed field (rather than a schema field)."""
    kind: Any = root
    for i, part in enumerate(path):
        kind = _strip_optional(kind)
        if dataclasses.is_dataclass(kind):
            hints = _hints(kind)  # type: ignore[arg-type]
            if part not in hints:
                raise Unsupported(".".join(path))
            kind = chosen[part] if i == 0 and part in chosen else hints[part]
        elif typing.get_origin(kind) is dict and i == len(path) - 1:
            return True
        else:
            raise Unsupported(".".join(path))
    return False


def _strip_optional(kind: Any) -> Any:
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return kind


def read_recipe(roots: tuple[Path, ...], name: str, selected: dict[str, str], seen: tuple[str, ...]) -> Any:
    """The merged body of recipe ``name`` and the recipes it builds on; applies their group overrides
    to ``selected`` (a recipe's own overrides after those of the recipes it names)."""
    if name in seen or len(seen) > 8:
        raise Unsupported(f"experiment {name} includes itself")
    package, body = _load(find(roots, f"experiment/{name}.yaml"))
    if package != "_global_":
        raise Unsupported(f"experiment {name} is not @package _global_")
    entries, body = _split_defaults(body)
    if "_self_" in entries and entries[-1] != "_self_":
        raise Unsupported(f"experiment {name}: _self_ before other defaults")
    merged: dict[str, Any] = {}
    for entry in entries:
        if entry == "_self_":
            continue
        if isinstance(entry, str):  # another recipe of the same group, merged first
            _merge(merged, read_recipe(roots, entry, selected, (*seen, name)))
            continue
        if not isinstance(entry, dict) or len(entry) != 1:
            raise Unsupported(f"defaults entry {entry!r}")
        ((key, option),) = entry.items()
        group = key.removeprefix("override /")
        if not key.startswith("override /") or group not in selected:
            raise Unsupported(f"defaults entry {entry!r}")
        selected[group] = option
    _merge(merged, body)
    return merged


@cache
def _hints(cls: type) -> dict[str, Any]:
    """The types of the dataclass fields of ``cls`` (class variables such as ``backend`` are not keys)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def build(cls: type, data: dict[str, Any], top_schemas: dict[str, type] | None = None) -> Any:
    """An instance of dataclass ``cls`` from ``data``: unknown keys, type mismatches and values left
    MISSING are Unsupported (Hydra then reports them in its own words)."""
    if not isinstance(data, dict):
        raise Unsupported(f"{cls.__name__} from {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(data) - set(fields)
    if unknown:
        raise Unsupported(f"unknown keys {sorted(unknown)} in {cls.__name__}")
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        kind = hints[name]
        if top_schemas and name in top_schemas:
            kind = top_schemas[name]
        if name in data:
            kwargs[name] = convert(kind, data[name], f)
        elif dataclasses.is_dataclass(kind) and f.default is MISSING:
            kwargs[name] = build(kind, {})  # type: ignore[arg-type]
        elif f.default is MISSING:
            raise Unsupported(f"{cls.__name__}.{name} is missing")
    return cls(**kwargs)


def convert(kind: Any, value: Any, f: dataclasses.Field[Any]) -> Any:
    """``value`` (from YAML or the command line) as a ``kind`` field; Unsupported when it is not one."""
    if value == MISSING:
        raise Unsupported("missing value")
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if value is None:
            return None
        if len(args) != 1:
            raise Unsupported(f"union {kind}")
        kind, origin = args[0], typing.get_origin(args[0])
    if value is None:
        raise Unsupported("None for a non-optional field")
    if dataclasses.is_dataclass(kind):
        return build(kind, value)  # type: ignore[arg-type]
    if origin is list:
        (item,) = typing.get_args(kind)
        if not isinstance(value, list):
            raise Unsupported("list expected")
        dc = dataclasses.is_dataclass(item)  # e.g. cluster.kube.volumes
        return [build(item, v) if dc else _scalar(item, v) for v in value]
    if origin is dict:
        key_t, item = typing.get_args(kind)
        if not isinstance(value, dict) or key_t is not str:
            raise Unsupported("dict expected")
        base = f.default_factory() if f.default_factory is not dataclasses.MISSING else {}
        return {**base, **{_scalar(str, k): _scalar(item, v) for k, v in value.items()}}
    return _scalar(kind, value)


def _scalar(kind: Any, value: Any) -> Any:
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        if isinstance(value, str) and value in kind.__members__:
            return kind[value]
        raise Unsupported(f"{value!r} for {kind.__name__}")
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is bool and isinstance(value, bool):
        return value
    if kind is int and is_number and isinstance(value, int):
        return value
    if kind is float and is_number:
        return float(value)
    if kind is Any or (kind is str and isinstance(value, str)):  # Any: YAML data as is (data.task_options)
        return copy.deepcopy(value)
    raise Unsupported(f"{value!r} for {kind}")
