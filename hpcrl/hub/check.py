"""Before a job is submitted: what it will read from the Hugging Face cache is there and complete."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from hpcrl.config.model import LOCAL_PREFIX
from hpcrl.config.preflight import check_records
from hpcrl.errors import ConfigError
from hpcrl.hub.cache import hub_dir, is_hub_id
from hpcrl.hub.fetch import wanted_sources
from hpcrl.hub.resolve import dataset_files, model_snapshot

if TYPE_CHECKING:
    from hpcrl.config.schema import RunConfig


def check_inputs(cfg: RunConfig) -> None:
    """The model and every ``hf:`` split resolve offline from the cache, as the job will resolve them
    (``model.fetch=job``: the job downloads them itself, nothing to check), each split's first record
    with the fields the run reads; a local model directory exists. One ConfigError line naming the key
    and the fix otherwise."""
    model = cfg.model
    if is_hub_id(model.hf_id):
        if model.fetch == "login":
            model_snapshot(hub_dir(cfg.cluster), model.hf_id, model.revision)
    elif (
        not model.hf_id.startswith(LOCAL_PREFIX)
        and not (Path(model.hf_id).expanduser() / "config.json").is_file()
    ):
        raise ConfigError(
            f"model.hf_id={model.hf_id} is neither a model directory here (no config.json) nor a hub id "
            "(org/name); fix the path"
        )
    if model.fetch == "login":
        for key, source, split in wanted_sources(cfg):
            files = dataset_files(hub_dir(cfg.cluster), source, split, key)
            if files:  # the fields the run reads, in the first record of the split's first file
                check_records(cfg.data, key, f"{key}={source}", files[0])


def pin_inputs(cfg: RunConfig) -> None:
    """What the job reads, fixed as it was checked: the model's revision becomes the commit the cache
    resolves it to now (a later ``hpcrl fetch`` of a moved branch, or a requeue days later, runs the
    same weights), and relative file paths become absolute (the job's container starts in its own
    working directory, not the one submit ran in)."""
    from hpcrl.hub.resolve import cached_snapshot

    model, data = cfg.model, cfg.data
    if is_hub_id(model.hf_id) and model.fetch == "login":
        snap = cached_snapshot(hub_dir(cfg.cluster), model.hf_id, "model", model.revision)
        if snap is not None:
            model.revision = snap.commit
    elif not model.hf_id.startswith(LOCAL_PREFIX):
        model.hf_id = _absolute(model.hf_id)
    if data.check_source:  # false: a path only the compute nodes see, as the user wrote it
        for key in ("source", "val_source"):
            value = getattr(data, key)
            if value and value != "synthetic" and not _SCHEME.match(value):
                setattr(data, key, _absolute(value))
    if cfg.checkpoint.dir:
        cfg.checkpoint.dir = _absolute(cfg.checkpoint.dir)


_SCHEME = re.compile(r"^[A-Za-z_][\w-]*:")
"""``hf:...``, ``reasoning_gym:...``: a data source that is not a file path."""


def _absolute(path: str) -> str:
    return os.path.normpath(os.path.abspath(os.path.expanduser(path)))
