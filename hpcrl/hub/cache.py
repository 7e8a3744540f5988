"""Where the site's Hugging Face cache is, and which ids name hub repositories."""

from __future__ import annotations

import os
import re
from pathlib import Path

from hpcrl.config.cluster import ClusterConfig, Scheduler
from hpcrl.config.model import LOCAL_PREFIX

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hf_home(cluster: ClusterConfig) -> Path:
    """The Hugging Face home the job uses: ``cluster.env.HF_HOME`` (the site key), else this shell's
    ``HF_HOME`` (sbatch exports the submitting environment), else huggingface_hub's default."""
    value = cluster.env.get("HF_HOME") or os.environ.get("HF_HOME")
    if value:
        return Path(value).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "huggingface"


def hub_dir(cluster: ClusterConfig) -> Path:
    """The hub cache under it (``HF_HUB_CACHE`` when this shell sets it for a local run)."""
    if cluster.scheduler is Scheduler.local and os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    return hf_home(cluster) / "hub"


def is_hub_id(hf_id: str) -> bool:
    """``org/name`` that is not a directory here: a hub repository (a local model directory, absolute
    or relative, keeps working as a path; ``local/...`` is built by hpcrl)."""
    if hf_id.startswith(LOCAL_PREFIX) or hf_id.startswith((".", "/", "~")):
        return False
    return bool(_REPO_ID.match(hf_id)) and not Path(hf_id).is_dir()
