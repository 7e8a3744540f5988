"""``hpcrl fetch``: the model and every ``hf:`` split a config reads, into the site's Hugging Face cache
(the downloads themselves are ``hpcrl/hub/fetch.py``'s, which the job uses too)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from hpcrl.errors import ConfigError
from hpcrl.hub.cache import hub_dir, is_hub_id
from hpcrl.hub.fetch import Fetched, fetch_model, fetch_split, wanted_sources

if TYPE_CHECKING:
    from hpcrl.config.schema import RunConfig


def fetch_all(cfg: RunConfig, say: Callable[[str], None] = print) -> list[Fetched]:
    """Fetch the model (when ``model.hf_id`` names a hub repository) and every ``hf:`` split."""
    try:
        import huggingface_hub  # noqa: F401 (the light install of hpcrl plans; fetching needs the client)
    except ImportError:
        raise ConfigError(
            "hpcrl fetch needs huggingface_hub: install hpcrl's cpu extra here (pip install 'hpcrl[cpu]') "
            "or pip install huggingface_hub"
        ) from None
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        raise ConfigError("HF_HUB_OFFLINE is set in this shell: unset it to fetch (hpcrl fetch downloads)")
    hub = hub_dir(cfg.cluster)
    try:
        hub.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"cannot create the cache {hub} ({exc.strerror}): set cluster.env.HF_HOME to a writable shared directory"
        ) from None
    say(
        f"cache {hub}"
        + (
            ""
            if cfg.cluster.env.get("HF_HOME")
            else " (set cluster.env.HF_HOME in site.yaml: shared storage)"
        )
    )
    done = []
    if is_hub_id(cfg.model.hf_id):
        done.append(fetch_model(hub, cfg.model.hf_id, cfg.model.revision, say, gguf=cfg.model.gguf))
    for key, source, split in wanted_sources(cfg):
        done.append(fetch_split(hub, source, split, key, say))
    if not done:
        say("nothing to fetch: the model is local and no data set is hf:")
    return done
