"""Checks that need more than one field's value: a registry (templates, verifiers), the model (layers
per pipeline stage) or the submitting machine (data files, verifier plugins). Each would otherwise pass
``hpcrl plan`` and fail inside the job, after the allocation's wait and Ray's start-up."""

from __future__ import annotations

import json
import os
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
    """``data.verifier`` must be registered: built in, or by a module of ``HPCRL_PLUGINS``, imported here
    as the reward processes will import it in the job."""
    if data.verifier in VERIFIER_NAMES:
        return
    plugins = os.environ.get("HPCRL_PLUGINS", "")
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
    record of a .jsonl/.parquet file must have the fields the run reads."""
    if not data.check_source:
        return
    if is_template_file(data.template):
        read_template(data.template)
    val_fields = (data.val_prompt_field or data.prompt_field, data.val_answer_field or data.answer_field)
    sources = (
        ("data.source", data.source, data.prompt_field, data.answer_field),
        ("data.val_source", data.val_source, *val_fields),
    )
    for key, source, *fields in sources:
        if not source or source == "synthetic" or source.startswith("hf:") or is_procedural(source):
            continue
        if not Path(source).exists():
            raise ConfigError(
                f"{key}={source} does not exist on this machine ({Path(source).absolute()}); fix the path, "
                "or set data.check_source=false if it is visible only on the compute nodes"
            )
        record = first_record(Path(source))
        if record is not None:
            for name in fields:
                record_field(record, name, f"{key}={source}")


def first_record(path: Path) -> dict[str, Any] | None:
    """The first record of a .jsonl or .parquet file (None: another format, or no record)."""
    if path.suffix == ".jsonl":
        with path.open() as f:
            line = next((line for line in f if line.strip()), None)
        return json.loads(line) if line else None
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        batch = next(pq.ParquetFile(path).iter_batches(batch_size=1), None)
        return batch.to_pylist()[0] if batch is not None and batch.num_rows else None
    return None
