"""Before a job is submitted: what it will read from the Hugging Face cache is there and complete."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from hpcrl.config.model import LOCAL_PREFIX
from hpcrl.errors import ConfigError
from hpcrl.hub.cache import hub_dir, is_hub_id
from hpcrl.hub.fetch import wanted_sources
from hpcrl.hub.resolve import dataset_files, model_snapshot

if TYPE_CHECKING:
    from hpcrl.config.schema import RunConfig


def check_inputs(cfg: RunConfig) -> None:
    """The model and every ``hf:`` split resolve offline from the cache, as the job will resolve them
    (``model.fetch=job``: the job downloads them itself, nothing to check); a local model directory
    exists. One ConfigError line naming the key and the fix otherwise."""
    model = cfg.model
    if model.hf_id.startswith(LOCAL_PREFIX):
        pass
    elif not is_hub_id(model.hf_id):
        if not (Path(model.hf_id).expanduser() / "config.json").is_file():
            raise ConfigError(
                f"model.hf_id={model.hf_id} is neither a model directory here (no config.json) nor a hub id "
                "(org/name); fix the path"
            )
    elif model.fetch == "login":
        model_snapshot(hub_dir(cfg.cluster), model.hf_id, model.revision)
    if model.fetch == "login":
        for key, source, split in wanted_sources(cfg):
            dataset_files(hub_dir(cfg.cluster), source, split, key)
