"""Composition: ``conf/`` + overrides -> a checked ``RunConfig``, through the Hydra-free composer
(``fastcompose``) for plain override sets, Hydra otherwise, with a pickle cache for repeat commands."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from hpcrl.config.schema import GROUP_SCHEMAS, RunConfig, register_schemas
from hpcrl.errors import ConfigError


def conf_dir() -> Path:
    """The ``conf/`` tree shipped beside the package (HPCRL_CONF_DIR overrides it)."""
    override = os.environ.get("HPCRL_CONF_DIR")
    if override:
        return Path(override).resolve()
    return Path(__file__).resolve().parents[2] / "conf"


def normalize_overrides(overrides: list[str]) -> list[str]:
    """Accept both ``+cluster=gb200`` (the documented form) and ``cluster=gb200``.

    Every group but ``experiment`` has a default, and every key exists in a schema, so ``+``
    (append) and ``++`` (force) are only meaningful for ``experiment`` and map entries such as
    ``+cluster.env.NCCL_DEBUG=INFO``; elsewhere they are
    stripped, which keeps struct mode in force: ``+trainer.typo=1`` fails like ``trainer.typo=1``.
    """
    out = []
    for item in overrides:
        bare = item.lstrip("+")
        key = bare.split("=", 1)[0]
        appends = key == "experiment" or (key.startswith(DICT_KEYS) and item.startswith("+"))
        out.append("+" + bare if appends else bare)
    return out


DICT_KEYS = ("cluster.env.",)
"""Free-form maps where ``+key=value`` legitimately adds an entry."""


EMBEDDED_DEFAULT = "grpo-tiny-1n1g-fsdp"
"""The recipe a bare command runs: no cluster, model or experiment chosen means this one."""


def with_embedded_default(overrides: list[str]) -> list[str]:
    chosen = {item.lstrip("+").split("=", 1)[0] for item in overrides}
    if chosen & {"cluster", "model", "experiment"}:
        return overrides
    return [f"+experiment={EMBEDDED_DEFAULT}", *overrides]


def compose_raw(overrides: list[str]) -> Any:
    """Hydra composition only (a DictConfig); errors become one-line ConfigErrors."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register_schemas()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
            return compose(
                config_name="config", overrides=normalize_overrides(with_embedded_default(overrides))
            )
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(explain_hydra_error(exc)) from None


def compose_config(overrides: list[str]) -> RunConfig:
    """Compose, convert to typed dataclasses and run the per-component checks.

    A successful composition is cached (see ``_cache_path``): the next ``hpcrl plan``/``render`` with
    the same overrides, conf/ tree and hpcrl code skips composing. A first composition of a plain
    override set skips Hydra too (``hpcrl.config.fastcompose``, about half a second of start-up); anything
    else, errors included, is composed by Hydra. HPCRL_FAST_COMPOSE=0 always uses Hydra."""
    cache = _cache_path(overrides)
    cached = _load_cached(cache)
    if cached is not None:
        return cached
    cfg = _compose_fast(overrides) or _compose_hydra(overrides)
    cfg.check()
    _store_cached(cache, cfg)
    return cfg


def _compose_fast(overrides: list[str]) -> RunConfig | None:
    if os.environ.get("HPCRL_FAST_COMPOSE", "1") == "0":
        return None
    from hpcrl.config import fastcompose

    normalized = normalize_overrides(with_embedded_default(overrides))
    cfg = fastcompose.compose(conf_dir(), normalized, GROUP_SCHEMAS, RunConfig)
    return cfg if isinstance(cfg, RunConfig) else None


def _compose_hydra(overrides: list[str]) -> RunConfig:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    raw = compose_raw(overrides)
    try:
        cfg = OmegaConf.to_object(raw)
    except OmegaConfBaseException as exc:
        raise ConfigError(explain_hydra_error(exc)) from None
    assert isinstance(cfg, RunConfig)
    return cfg


def _cache_path(overrides: list[str]) -> Path | None:
    """Key: the overrides, the name/size/mtime of every file under conf/ and hpcrl/ (the schemas and
    the code that checks them), the Python version. Any edit there is a miss. HPCRL_COMPOSE_CACHE=0
    turns the cache off."""
    import hashlib
    import sys

    if os.environ.get("HPCRL_COMPOSE_CACHE", "1") == "0":
        return None
    digest = hashlib.sha256("\0".join([sys.version, *overrides]).encode())
    for root in (conf_dir(), Path(__file__).resolve().parents[1]):
        for path in sorted(root.rglob("*")):
            if path.suffix in (".yaml", ".py"):
                st = path.stat()
                digest.update(f"{path}:{st.st_size}:{st.st_mtime_ns}".encode())
    return cache_dir() / "compose" / f"{digest.hexdigest()[:32]}.pkl"


def cache_dir() -> Path:
    """hpcrl's cache (tiny model, composed configs): ``$HPCRL_CACHE`` or ``~/.cache/hpcrl``."""
    return Path(os.environ.get("HPCRL_CACHE", Path.home() / ".cache" / "hpcrl"))


def _load_cached(path: Path | None) -> RunConfig | None:
    import pickle

    if path is None or not path.exists():
        return None
    try:
        cfg = pickle.loads(path.read_bytes())
    except Exception:  # a partial or stale file is only a miss
        return None
    return cfg if isinstance(cfg, RunConfig) else None


def _store_cached(path: Path | None, cfg: RunConfig) -> None:
    import pickle

    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_bytes(pickle.dumps(cfg))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home only costs the speed-up


def explain_hydra_error(exc: BaseException) -> str:
    """Reduce Hydra/OmegaConf messages to one line that names the key, plus a fix."""
    text = str(exc).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = lines[0] if lines else type(exc).__name__
    cause = exc.__cause__ or exc.__context__
    cause_line = str(cause).strip().splitlines()[0] if cause and str(cause).strip() else ""
    unknown = re.search(r"Could not override '([^']+)'|Key '([^']+)' (?:is )?not in struct", text)
    if unknown:
        key = unknown.group(1) or unknown.group(2)
        group, _, leaf = key.partition(".")
        if leaf == "backend" and group in ("trainer", "rollout"):
            choices = " or ".join(f"{group}={p.stem}" for p in sorted((conf_dir() / group).glob("*.yaml")))
            return f"unknown key '{key}': the {group} group chooses the backend; use {choices} instead"
        return f"unknown key '{key}': no such field in the schema; check the spelling (`hpcrl show` lists every key)"
    if "Available options" in text:
        listed = text.split("Available options", 1)[1].split("Config search path", 1)[0]
        options = [
            o.strip() for o in listed.splitlines()[1:] if o.strip() and not o.strip().endswith("_schema")
        ]
        missing = re.search(r"Could not find '([^']+)'", text)
        what = missing.group(1) if missing else first
        return f"unknown config '{what}'; available: {', '.join(options)}"
    missing = re.search(r"Could not (?:find|load) '([^']+)'", text)
    if missing:
        return f"unknown config '{missing.group(1)}'; `hpcrl show --groups` lists what exists"
    merge = re.search(r"Error merging override (\S+)", text)
    if merge:
        return f"bad value in override '{merge.group(1)}': {cause_line or first}"
    key = getattr(exc, "full_key", None)
    if "Missing mandatory value" in text and key:
        return f"{key} is required but not set; add {key}=<value>"
    if key:
        return f"{key}: {first}"
    return " ".join(lines[:3])
