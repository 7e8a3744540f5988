"""The run configuration: typed schemas registered once, composed by Hydra from ``conf/``.

YAML files in ``conf/`` only select and override; every key they set must exist in a schema
here (struct mode), so a typo fails at composition with the key named.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcrl.algo.config import AlgoConfig
from hpcrl.checks import MISSING, positive
from hpcrl.cluster import ClusterConfig
from hpcrl.data.config import DataConfig
from hpcrl.errors import ConfigError
from hpcrl.models import ModelConfig
from hpcrl.rollout.config import HFRolloutConfig, RolloutConfig, VLLMRolloutConfig
from hpcrl.trainer.config import FSDPTrainerConfig, MegatronTrainerConfig, TrainerConfig

GROUPS = ("cluster", "model", "algo", "trainer", "rollout", "data", "experiment")


@dataclass
class LayoutConfig:
    """How many nodes do what. ``rollout_nodes: 0`` colocates rollout and training on every node."""

    train_nodes: int = 1
    rollout_nodes: int = 0


@dataclass
class CheckpointConfig:
    enabled: bool = True
    period: int = 10
    """Save every N steps (and before the Slurm time limit)."""
    keep_top_k: int = 3
    metric: str = "val/accuracy"
    higher_is_better: bool = True
    dir: str | None = None
    """None: ``<run dir>/checkpoints``."""


@dataclass
class LoggerConfig:
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "hpcrl"
    wandb_mode: str = "offline"
    """'offline' works without network; 'online' needs WANDB_API_KEY in the environment."""


@dataclass
class RunMeta:
    name: str = "hpcrl"
    seed: int = 1234
    output_root: str = "runs"
    """Where run directories are created (must be on the shared filesystem for Slurm)."""
    dir: str | None = None
    """Exact run directory; None creates ``<output_root>/<name>-<timestamp>``."""


@dataclass
class RunConfig:
    cluster: ClusterConfig = MISSING
    model: ModelConfig = MISSING
    algo: AlgoConfig = MISSING
    trainer: TrainerConfig = MISSING
    rollout: RolloutConfig = MISSING
    data: DataConfig = MISSING
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    run: RunMeta = field(default_factory=RunMeta)

    def check(self) -> None:
        """Per-component value checks; cross-component rules live in the topology and quirks."""
        for part in (self.cluster, self.model, self.algo, self.trainer, self.rollout, self.data):
            part.check()
        positive("layout.train_nodes", self.layout.train_nodes)
        if self.layout.rollout_nodes < 0:
            raise ConfigError(
                f"layout.rollout_nodes={self.layout.rollout_nodes} must be >= 0 (0 = colocated)"
            )
        positive("checkpoint.period", self.checkpoint.period)
        positive("checkpoint.keep_top_k", self.checkpoint.keep_top_k)
        if self.logger.wandb_mode not in ("offline", "online", "disabled"):
            raise ConfigError(
                f"logger.wandb_mode='{self.logger.wandb_mode}' must be offline, online or disabled"
            )

    @property
    def max_seq_len(self) -> int:
        return self.trainer.max_seq_len or self.data.max_prompt_tokens + self.rollout.max_new_tokens


_registered = False


def register_schemas() -> None:
    """Register every schema with Hydra's ConfigStore (once per process)."""
    global _registered
    if _registered:
        return
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="hpcrl_schema", node=RunConfig)
    for (group, name), schema in GROUP_SCHEMAS.items():
        cs.store(group=group, name=name, node=schema)
    _registered = True


GROUP_SCHEMAS: dict[tuple[str, str], type] = {
    ("trainer", "fsdp_schema"): FSDPTrainerConfig,
    ("trainer", "megatron_schema"): MegatronTrainerConfig,
    ("rollout", "vllm_schema"): VLLMRolloutConfig,
    ("rollout", "hf_schema"): HFRolloutConfig,
}
"""cluster/model/algo/data are typed by RunConfig itself; only the groups whose schema depends on the
option chosen (trainer, rollout) need a schema each for their YAML files to extend."""


def conf_dir() -> Path:
    """The ``conf/`` tree shipped beside the package (HPCRL_CONF_DIR overrides it)."""
    override = os.environ.get("HPCRL_CONF_DIR")
    if override:
        return Path(override).resolve()
    return Path(__file__).resolve().parent.parent / "conf"


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
    override set skips Hydra too (``hpcrl.fastcompose``, about half a second of start-up); anything
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
    from hpcrl import fastcompose

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
    for root in (conf_dir(), Path(__file__).resolve().parent):
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
