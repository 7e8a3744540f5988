"""Checks that need more than one field's value: a registry (templates, verifiers), the model (layers
per pipeline stage) or the submitting machine (data files, verifier plugins). Each would otherwise pass
``hpcrl plan`` and fail inside the job, after the allocation's wait and Ray's start-up."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
from importlib.machinery import ModuleSpec
from pathlib import Path
from typing import Any

import yaml

from hpcrl.config.model import LOCAL_PREFIX, ModelConfig
from hpcrl.config.paths import conf_dirs, group_options
from hpcrl.core.checks import divisors
from hpcrl.data.config import (
    TEMPLATE_FILES,
    TEMPLATES,
    DataConfig,
    is_procedural,
    is_template_file,
    read_template,
    record_field,
)
from hpcrl.errors import ConfigError
from hpcrl.rewards.config import VERIFIER_NAMES, load_plugins
from hpcrl.trainer.backends import trainer_spec
from hpcrl.trainer.config import TrainerConfig


def check_run(data: DataConfig, model: ModelConfig, trainer: TrainerConfig) -> None:
    """The checks that depend on the config alone (their result is cached with it)."""
    check_template(data)
    check_synthetic(data, model)
    check_pipeline_stages(model, trainer)


def check_environment(data: DataConfig) -> None:
    """The checks whose answer this machine gives (files, HPCRL_PLUGINS): run on every command, cached
    config or not, since the answer may change between two commands."""
    check_verifier(data)
    check_paths(data)


def check_template(data: DataConfig) -> None:
    if data.template not in TEMPLATES and not is_template_file(data.template):
        raise ConfigError(
            f"data.template={data.template} is not a prompt template; use one of: {', '.join(TEMPLATES)} "
            f"(hpcrl/data/config.py: TEMPLATES), or a file ending in {', '.join(TEMPLATE_FILES)}"
        )


def check_synthetic(data: DataConfig, model: ModelConfig) -> None:
    """The built-in arithmetic task (character-level, 64-token prompts) is what the tiny ``local/`` models
    learn on a laptop; any other model would spend its allocation on it. A real model without a data
    choice gets a real data set instead (``hpcrl.config.defaults``): this refuses an explicit choice."""
    if data.source != "synthetic":
        return
    local = local_in_catalog(model.name)
    if local or (local is None and model.hf_id.startswith(LOCAL_PREFIX)):
        return
    raise ConfigError(
        f"data={data.name} with data.source=synthetic is the built-in arithmetic task, for the tiny local "
        f"models only; {model.name} needs a real data set: data= one of {', '.join(real_data_options())} "
        "(`hpcrl show --groups` lists them)"
    )


def local_in_catalog(model: str) -> bool | None:
    """Whether the catalog's ``model`` is one hpcrl builds itself (its file's ``hf_id`` is ``local/...``:
    the tiny models), whatever ``model.hf_id`` a command line gives it (the same tiny network served from
    a hub stays tiny); None: no catalog file of that name."""
    from hpcrl.config import fastcompose

    try:
        path = fastcompose.find(conf_dirs(), f"model/{model}.yaml")
        body = yaml.load(path.read_text(), fastcompose.yaml_loader())
    except (fastcompose.Unsupported, OSError, yaml.YAMLError):
        return None
    hf_id = body.get("hf_id") if isinstance(body, dict) else None
    return hf_id.startswith(LOCAL_PREFIX) if isinstance(hf_id, str) else None


def real_data_options() -> list[str]:
    """The ``data`` options (hpcrl's and the site's) whose source is not the synthetic task."""
    from hpcrl.config import fastcompose

    real = []
    for option in group_options("data"):
        path = fastcompose.find(conf_dirs(), f"data/{option}.yaml")
        body = yaml.load(path.read_text(), fastcompose.yaml_loader())
        if not isinstance(body, dict) or body.get("source") != "synthetic":
            real.append(option)
    return real


def check_verifier(data: DataConfig) -> None:
    """Every ``HPCRL_PLUGINS`` module must be found here, as the reward processes will import it in the
    job, and ``data.verifier`` must be built in or registered by one. Found, not imported: a plugin may
    import torch, which the planner does not; a module is imported only when its source shows no
    ``register('<data.verifier>')`` (registered some other way)."""
    plugins = os.environ.get("HPCRL_PLUGINS", "")
    modules = [m.strip() for m in plugins.split(",") if m.strip()]
    for module in modules:
        if _spec(module) is None:
            raise ConfigError(
                f"HPCRL_PLUGINS={plugins}: no module {module} here (the job's reward processes import it); "
                "fix the name or its PYTHONPATH"
            )
    if data.verifier in VERIFIER_NAMES or any(data.verifier in registered(m) for m in modules):
        return
    try:
        load_plugins(plugins)
    except Exception as exc:  # a broken plugin fails here, not in every reward process of the job
        raise ConfigError(
            f"data.verifier={data.verifier}: HPCRL_PLUGINS={plugins} does not import here "
            f"({type(exc).__name__}: {exc}); fix the module or its PYTHONPATH"
        ) from None
    if data.verifier not in VERIFIER_NAMES:
        where = f"HPCRL_PLUGINS={plugins} registers" if plugins else "no HPCRL_PLUGINS module registers"
        raise ConfigError(
            f"data.verifier={data.verifier} is not a verifier ({where} it); use one of: "
            f"{', '.join(sorted(VERIFIER_NAMES))}, or register yours with @register('{data.verifier}') in a module "
            "named by HPCRL_PLUGINS"
        )


def _spec(module: str) -> ModuleSpec | None:
    """Where ``module`` would be imported from (its parent packages are imported to find it)."""
    try:
        return importlib.util.find_spec(module)
    except (ImportError, ValueError):  # a parent package missing, or broken
        return None


def registered(module: str) -> set[str]:
    """The names ``module``'s own source registers with a literal ``register('name')`` call."""
    spec = _spec(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return set()
    tree = ast.parse(Path(spec.origin).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            if name == "register" and isinstance(node.args[0].value, str):
                names.add(node.args[0].value)
    return names


def check_pipeline_stages(model: ModelConfig, trainer: TrainerConfig) -> None:
    """Megatron cuts the layers into ``trainer.pp`` equal stages (no uneven first/last stage here); the
    fsdp backend's pp>1 is refused by the planner with its own message."""
    pp, layers = trainer.pp, model.num_layers
    if "pp" in trainer_spec(trainer).degrees and layers % pp:
        options = ", ".join(str(d) for d in divisors(layers) if d <= 64)
        raise ConfigError(
            f"trainer.pp={pp} does not divide {model.name}'s {layers} layers (model.num_layers): "
            f"pipeline stages hold equal numbers of layers; use trainer.pp in {options}"
        )


def check_paths(data: DataConfig) -> None:
    """Data files must exist where the job will look for them, checked from this (the submitting)
    machine: a relative path is relative to the directory the job starts in, this one. The first
    record of a .jsonl/.parquet file must parse and have the fields the run reads."""
    if not data.check_source:
        return
    if is_template_file(data.template):
        read_template(data.template)
    for key in ("data.source", "data.val_source"):
        source = getattr(data, key.removeprefix("data."))
        if not source or source == "synthetic" or source.startswith("hf:") or is_procedural(source):
            continue
        if not Path(source).exists():
            raise ConfigError(
                f"{key}={source} does not exist on this machine ({Path(source).absolute()}); fix the path, "
                "or set data.check_source=false if it is visible only on the compute nodes"
            )
        check_records(data, key, f"{key}={source}", Path(source))


def check_records(data: DataConfig, key: str, named: str, path: Path) -> None:
    """The first record of ``path`` (a file of the source ``key``, ``named`` so in messages) parses and
    holds the fields the run reads from it; a format it cannot peek into (.json) is left to the job."""
    record = first_record(path, named)
    if record is None:
        return
    val = key == "data.val_source"
    prompt = (data.val_prompt_field if val else None) or data.prompt_field
    answer = (data.val_answer_field if val else None) or data.answer_field
    for name in (prompt, answer):
        record_field(record, name, named)
    if data.image_field:
        try:
            record_field(record, data.image_field, named)
        except ConfigError:
            raise ConfigError(
                f"{named}: records have no field '{data.image_field}' (data.image_field); name the field "
                "that holds the images, or drop data.image_field for a text data set"
            ) from None


def first_record(path: Path, named: str = "") -> dict[str, Any] | None:
    """The first record of a .jsonl or .parquet file (None: another format). A file without a record,
    or whose first one does not parse, is a ConfigError naming ``named`` (the key and its value)."""
    named = named or str(path)
    if path.suffix == ".jsonl":
        record = _first_line(path, named)
    elif path.suffix == ".parquet":
        record = _first_row(path, named)
    else:
        return None
    if record is None:
        raise ConfigError(f"{named} holds no record; point it at the data set's file")
    if not isinstance(record, dict):
        raise ConfigError(
            f"{named}: the first record is a JSON {type(record).__name__}, not an object with fields; "
            "a .jsonl file holds one object per line"
        )
    return record


def _first_line(path: Path, named: str) -> Any:
    with path.open() as f:
        found = next(((n, line) for n, line in enumerate(f, 1) if line.strip()), None)
    if found is None:
        return None
    try:
        return json.loads(found[1])
    except json.JSONDecodeError as exc:  # the job would die reading it, after the allocation's wait
        raise ConfigError(
            f"{named}: line {found[0]} is not JSON ({exc.msg}, column {exc.colno}); a .jsonl file holds "
            "one JSON object per line"
        ) from None


def _first_row(path: Path, named: str) -> dict[str, Any] | None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        batch = next(pq.ParquetFile(path).iter_batches(batch_size=1), None)
    except (pa.ArrowException, OSError) as exc:
        raise ConfigError(
            f"{named} is not a readable parquet file ({exc}); fix the file or the path"
        ) from None
    return batch.to_pylist()[0] if batch is not None and batch.num_rows else None
