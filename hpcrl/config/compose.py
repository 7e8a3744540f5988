"""Composition: ``conf/`` + overrides -> a checked ``RunConfig``, through the Hydra-free composer
(``fastcompose``) for plain override sets, Hydra otherwise, with a pickle cache for repeat commands."""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any

from hpcrl.config.defaults import with_defaults
from hpcrl.config.paths import conf_dir, conf_dirs
from hpcrl.config.schema import GROUP_SCHEMAS, GROUPS, RunConfig, register_schemas
from hpcrl.errors import ConfigError


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
        if key == "experiment":
            bare = f"experiment={recipe_name(bare.split('=', 1)[1])}"
        out.append("+" + bare if appends else bare)
    return out


RECIPE_SUFFIXES = (".yaml", "-automodel", "-b200")
"""What the seeds' recipe names carry beyond hpcrl's: the file ending, NeMo RL's backend tag (its
AutoModel is hpcrl's fsdp) and the cluster (hpcrl's recipes name theirs in ``cluster``)."""
RECIPE_ALIASES = {"vlm_grpo-gemma4-e4b-geo3k-1n8g": "vlm_grpo-gemma4-e4b-it-1n8g-fsdp2"}
"""Seed recipe names that differ from hpcrl's beyond ``RECIPE_SUFFIXES``."""


def recipe_name(name: str) -> str:
    """``+experiment=`` as typed -> the recipe it means: itself when there is one, else the seeds'
    spelling of an hpcrl recipe (``grpo-gemma3-1b-it-1n8g-fsdp2tp1-b200.yaml``); an unknown name
    stays as it is (the error suggests the nearest)."""

    def known(recipe: str) -> bool:
        return any((d / "experiment" / f"{recipe}.yaml").exists() for d in conf_dirs())

    if known(name):
        return name
    short = name
    for suffix in reversed(RECIPE_SUFFIXES):
        short = short.removesuffix(".yaml").removesuffix(suffix)
    short = RECIPE_ALIASES.get(short, short)
    return short if known(short) else name


DICT_KEYS = ("cluster.env.", "cluster.slurm.extra_sbatch.", "data.task_options.")
"""Free-form maps where ``+key=value`` legitimately adds an entry (a task option: its own check names
the task's options, ``hpcrl/data/procedural.py``)."""


NAMED_GROUPS = ("cluster", "model", "algo", "data")
"""Groups whose schema has a ``name``: it must be the option that chose it (site.yaml and the plan's
recipe hints find a cluster by it)."""


def compose_raw(overrides: list[str]) -> Any:
    """Hydra composition only (a DictConfig, site keys applied); errors become one-line ConfigErrors."""
    from omegaconf import OmegaConf, open_dict

    raw, choices = _hydra_compose(overrides)
    names = {g: OmegaConf.select(raw, f"{g}.name", throw_on_missing=False) for g in NAMED_GROUPS}
    check_group_names(
        {g: n for g, n in names.items() if isinstance(n, str) and n != "???"}, choices, overrides
    )
    applied, _ = site_split(choices["cluster"], overrides)
    with open_dict(raw.cluster.env):  # a site may add variables; every other key is a schema field
        for key in applied:
            _update(raw, key.dotted, key.value)
    return raw


def _hydra_compose(overrides: list[str]) -> tuple[Any, dict[str, str]]:
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import open_dict
    from omegaconf.errors import OmegaConfBaseException

    register_schemas()
    search = [f"hydra.searchpath=['file://{d}']" for d in conf_dirs()[1:]]
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
            raw = compose(
                config_name="config",
                overrides=[*normalize_overrides(with_defaults(overrides)), *search],
                return_hydra_config=True,
            )
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(explain_hydra_error(exc)) from None
    choices = {g: str(raw.hydra.runtime.choices[g]) for g in GROUPS if g in raw.hydra.runtime.choices}
    with open_dict(raw):
        del raw["hydra"]
    return raw, choices


def _update(raw: Any, dotted: str, value: Any) -> None:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        OmegaConf.update(raw, dotted, value, merge=False)
    except OmegaConfBaseException as exc:
        raise ConfigError(explain_hydra_error(exc)) from None


def command_line_keys(overrides: list[str]) -> set[str]:
    """The dotted keys ``overrides`` set (group choices and recipes excluded)."""
    keys = {item.lstrip("+~").split("=", 1)[0] for item in overrides}
    return {k for k in keys if "." in k}


def show_text(overrides: list[str], groups: bool) -> str:
    """``hpcrl show``: the composed config as YAML, then where each site key came from; or (``groups``)
    the options of every config group, the site's included."""
    from omegaconf import OmegaConf

    from hpcrl.config.paths import group_options

    if groups:
        return "".join(f"{group}: {', '.join(group_options(group))}\n" for group in GROUPS)
    raw = compose_raw(overrides)
    sources = site_sources(raw.cluster.name, overrides)
    return str(OmegaConf.to_yaml(raw)) + "".join(f"{line}\n" for line in sources)


def site_sources(cluster: str, overrides: list[str]) -> list[str]:
    """For ``hpcrl show``: one comment line per site key of ``cluster``, naming the file and line that
    set it (or the command line that overrode it)."""
    from hpcrl.config.paths import site_file

    applied, overridden = site_split(cluster, overrides)
    path = site_file()
    lines = [f"# {k.dotted}: {path}:{k.line}" for k in applied]
    return lines + [f"# {k.dotted}: the command line (over {path}:{k.line})" for k in overridden]


def site_split(cluster: str, overrides: list[str]) -> tuple[list[Any], list[Any]]:
    """(applied, overridden by the command line) site keys of ``cluster``; the site module is imported
    only where a site file exists (most commands of most users: one stat)."""
    from hpcrl.config.paths import site_file

    if not site_file().exists():
        return [], []
    from hpcrl.config.site import site_keys, split_by_command_line

    return split_by_command_line(site_keys(cluster), command_line_keys(overrides))


def check_group_names(names: dict[str, str], choices: dict[str, str], overrides: list[str]) -> None:
    """A group's ``name`` field must be the option chosen: ``+cluster=gb200 cluster.name=h100`` plans
    GB200 hardware under another cluster's name (and its site keys)."""
    for group, name in names.items():
        option = choices.get(group)
        if option is None or name == option:
            continue
        if f"{group}.name" in command_line_keys(overrides):
            raise ConfigError(
                f"{group}.name={name} contradicts the {group} group's choice '{option}': the group sets "
                f"the name; drop {group}.name=... (to run {name}, choose {group}={name})"
            )
        where = next(
            (d / group / f"{option}.yaml" for d in conf_dirs() if (d / group / f"{option}.yaml").exists()),
            None,
        )
        raise ConfigError(
            f"{where or group + '/' + option}: name: {name} contradicts the file's option '{option}'; "
            f"set name: {option} (a group file is chosen by its file name)"
        )


def compose_config(overrides: list[str]) -> RunConfig:
    """Compose, convert to typed dataclasses and run the per-component checks.

    A successful composition is cached (see ``_cache_path``): the next ``hpcrl plan``/``render`` with
    the same overrides, conf/ trees, site file and hpcrl code skips composing. A first composition of a
    plain override set skips Hydra too (``hpcrl.config.fastcompose``, about half a second of start-up);
    anything else, errors included, is composed by Hydra. HPCRL_FAST_COMPOSE=0 always uses Hydra.
    What this machine decides (``preflight.check_environment``: data files, verifier plugins) is checked
    every time, cached or not."""
    from hpcrl.config.preflight import check_environment

    cache = _cache_path(overrides)
    cfg = _load_cached(cache)
    if cfg is None:
        cfg = _compose_fast(overrides) or _compose_hydra(overrides)
        cfg.check()
        _store_cached(cache, cfg)
    check_environment(cfg.data)
    return cfg


def _compose_fast(overrides: list[str]) -> RunConfig | None:
    if os.environ.get("HPCRL_FAST_COMPOSE", "1") == "0":
        return None
    from hpcrl.config import fastcompose

    def site(cluster: str) -> list[tuple[str, Any]]:
        applied, _ = site_split(cluster, overrides)
        return [(key.dotted, key.value) for key in applied]

    normalized = normalize_overrides(with_defaults(overrides))
    found = fastcompose.compose_with_choices(conf_dirs(), normalized, GROUP_SCHEMAS, RunConfig, site)
    if found is None or not isinstance(found[0], RunConfig):
        return None
    cfg, choices = found
    check_group_names({g: getattr(cfg, g).name for g in NAMED_GROUPS}, choices, overrides)
    return cfg


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
    """Key: the overrides, the name/size/mtime of every file under the conf/ trees, the site file and
    hpcrl/ (the schemas and the code that checks them), the Python version. Any edit there is a miss.
    HPCRL_COMPOSE_CACHE=0 turns the cache off."""
    import hashlib
    import sys

    from hpcrl.config.paths import site_file

    if os.environ.get("HPCRL_COMPOSE_CACHE", "1") == "0":
        return None
    digest = hashlib.sha256("\0".join([sys.version, *overrides]).encode())
    site = site_file()
    files = [site] if site.exists() else []
    for root in (*conf_dirs(), Path(__file__).resolve().parents[1]):
        files += sorted(p for p in root.rglob("*") if p.suffix in (".yaml", ".py"))
    for path in files:
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


def _file_line(relative: str, key: str) -> str:
    """``path:line`` of ``key`` in the conf file ``relative`` (the first line that sets it)."""
    for base in conf_dirs():
        path = base / relative
        if path.is_file():
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if re.match(rf"\s*{re.escape(key)}\s*:", line):
                    return f"{path}:{number}"
            return str(path)
    return relative


def explain_hydra_error(exc: BaseException) -> str:
    """Reduce Hydra/OmegaConf messages to one line that names the key, plus a fix."""
    text = str(exc).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = lines[0] if lines else type(exc).__name__
    cause = exc.__cause__ or exc.__context__
    cause_line = str(cause).strip().splitlines()[0] if cause and str(cause).strip() else ""
    in_file = re.search(
        r"^In '([^']+)': \w+ raised while composing config:\s*(.+?)\s*full_key: ([\w.]+)", text, re.S
    )
    if in_file:  # a conf file (hpcrl's or the site's) holds the bad key or value
        option, problem, key = in_file.groups()
        leaf = key.rsplit(".", 1)[-1]
        where = _file_line(f"{option}.yaml", leaf)
        unknown_field = re.match(r"Key '[^']+' not in '(\w+)'", problem)
        if unknown_field:
            return f"{where}: unknown key '{leaf}' ({unknown_field.group(1)} has no such field); check the spelling"
        return f"{where}: {key}: {' '.join(problem.split())}"
    unknown = re.search(r"Could not override '([^']+)'|Key '([^']+)' (?:is )?not in struct", text)
    if unknown:
        key = unknown.group(1) or unknown.group(2)
        group, _, leaf = key.partition(".")
        if leaf == "backend" and group in ("trainer", "rollout"):
            choices = " or ".join(f"{group}={p.stem}" for p in sorted((conf_dir() / group).glob("*.yaml")))
            return f"unknown key '{key}': the {group} group chooses the backend; use {choices} instead"
        if key.startswith(DICT_KEYS):  # site.yaml entries are applied after composition: add them too
            return f"'{key}' is a new entry for the catalog and the recipe: add it with +{key}=..."
        inner = re.match(r"Key '(\w+)' not in '(\w+)'", cause_line)
        if inner and inner.group(1) != leaf.rsplit(".", 1)[-1]:  # the key exists; a value inside it does not
            field, schema = inner.groups()
            return f"{key}: unknown key '{field}' ({schema} has no such field); check the spelling"
        return f"unknown key '{key}': no such field in the schema; check the spelling (`hpcrl show` lists every key)"
    if "Available options" in text:
        listed = text.split("Available options", 1)[1].split("Config search path", 1)[0]
        options = [
            o.strip() for o in listed.splitlines()[1:] if o.strip() and not o.strip().endswith("_schema")
        ]
        missing = re.search(r"Could not find '([^']+)'", text)
        what = missing.group(1) if missing else first
        near = difflib.get_close_matches(what.rsplit("/", 1)[-1], options, n=3, cutoff=0.6)
        hint = f"did you mean {' or '.join(near)}? " if near else ""
        return f"unknown config '{what}'; {hint}available: {', '.join(options)}"
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
