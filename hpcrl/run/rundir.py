"""Run directories: where a run's resolved config, sbatch script, logs and checkpoints live."""

from __future__ import annotations

import dataclasses
import os
import time
from enum import Enum
from pathlib import Path
from typing import Any

from hpcrl.config.schema import RunConfig


def new_run_dir(cfg: RunConfig) -> Path:
    if cfg.run.dir:
        return Path(cfg.run.dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path(cfg.run.output_root) / f"{cfg.run.name}-{stamp}"


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def config_yaml(cfg: RunConfig) -> str:
    """The resolved config as YAML (quirks applied). Holds no secrets: the schemas have no secret fields.
    Plain PyYAML rather than OmegaConf: ``hpcrl render`` stays clear of the OmegaConf import."""
    import yaml

    # the backends are the schema classes the groups chose, not keys: name them for readers (and wandb)
    head = f"# trainer={cfg.trainer.backend} rollout={cfg.rollout.backend}\n"
    return head + str(yaml.safe_dump(_plain(cfg), sort_keys=False, default_flow_style=False))


def write_resolved_config(cfg: RunConfig, run_dir: Path) -> Path:
    path = run_dir / "config.yaml"
    atomic_write_text(path, config_yaml(cfg))
    return path


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
