"""A catalog model (``conf/model/<name>.yaml``, hpcrl's or the site's) by name, for a model the run
serves beside its own (``rewards.judge.model``)."""

from __future__ import annotations

import yaml

from hpcrl.config.model import ModelConfig
from hpcrl.config.paths import conf_dirs
from hpcrl.errors import ConfigError


def catalog_model(name: str, key: str) -> ModelConfig:
    """The catalog's ``name`` as a ``ModelConfig``; ConfigError naming ``key`` when there is none."""
    from hpcrl.config import fastcompose

    try:
        path = fastcompose.find(conf_dirs(), f"model/{name}.yaml")
    except fastcompose.Unsupported:
        names = sorted({p.stem for d in conf_dirs() for p in (d / "model").glob("*.yaml")})
        raise ConfigError(f"{key}={name} is no catalog model: use one of {', '.join(names)}") from None
    body = yaml.load(path.read_text(), fastcompose.yaml_loader())
    body = {k: v for k, v in body.items() if k != "defaults"}
    try:
        model = fastcompose.build(ModelConfig, body)
    except fastcompose.Unsupported as exc:
        raise ConfigError(f"{key}={name}: {path} does not read as a model ({exc})") from None
    assert isinstance(model, ModelConfig)
    return model
