"""The run configuration: typed schemas registered once, composed by Hydra from ``conf/``.

YAML files in ``conf/`` only select and override; every key they set must exist in a schema
here (struct mode), so a typo fails at composition with the key named.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hpcrl.algo.config import AlgoConfig
from hpcrl.config.cluster import ClusterConfig
from hpcrl.config.eval import EvalConfig
from hpcrl.config.model import ModelConfig
from hpcrl.config.preflight import check_run
from hpcrl.core.checks import MISSING, positive
from hpcrl.data.config import DataConfig
from hpcrl.envs.config import EnvConfig
from hpcrl.errors import ConfigError
from hpcrl.rewards.config import RewardsConfig
from hpcrl.rollout.backends import (
    inflight_updates,
    logprob_sampling,
    rollout_spec,
    sends_logprobs,
    served_weights,
)
from hpcrl.rollout.config import HFRolloutConfig, RolloutConfig, VLLMRolloutConfig
from hpcrl.trainer.backends import optimizer_gap, trainer_spec
from hpcrl.trainer.config import FSDPTrainerConfig, MegatronTrainerConfig, TrainerConfig

GROUPS = ("cluster", "model", "algo", "trainer", "rollout", "data", "experiment")


@dataclass
class LayoutConfig:
    """How many nodes do what. ``rollout_nodes: 0`` colocates rollout and training on every node."""

    train_nodes: int = 1
    rollout_nodes: int = 0
    auto: bool | None = None
    """Auto layout (``hpcrl/plan/search.py``): None searches only when this layout does not fit, true
    always searches (nodes, placement, trainer/rollout parallelism), false never does."""


RANKED_METRICS: dict[str, bool | None] = {
    "val/accuracy": True,
    "val/parse_error_rate": False,
    "val/mean_gen_tokens": None,
    "train/reward": True,
    "train/accuracy": True,
    "train/parse_error_rate": False,
    "train/mean_gen_tokens": None,
    "train/truncated_rate": False,
}
"""What ``checkpoint.metric`` may rank by: metrics the loop logs at every step that validates
(``run/loop.py``; tests/run/test_embedded.py holds them logged), each with the direction that is better
(None: either is a choice)."""


@dataclass
class CheckpointConfig:
    enabled: bool = True
    period: int = 10
    """Save every N steps (and before the Slurm time limit)."""
    keep_top_k: int = 3
    metric: str = "val/accuracy"
    """Which checkpoints ``keep_top_k`` keeps (the latest always stays): one of ``RANKED_METRICS``."""
    higher_is_better: bool = True
    dir: str | None = None
    """None: ``<run dir>/checkpoints``."""
    async_save: bool = True
    """Trainer ranks copy their shards to host memory and write them while the next step runs (the
    last step's and a preemption's save are written before the run goes on)."""
    resume_weights_only: bool = False
    """Resume the weights but start the optimizer afresh: for a checkpoint whose optimizer state this
    layout cannot take."""

    def check(self) -> None:
        positive("checkpoint.period", self.period)
        positive("checkpoint.keep_top_k", self.keep_top_k)
        if self.metric not in RANKED_METRICS:
            raise ConfigError(
                f"checkpoint.metric={self.metric} is not a metric the run logs, so no checkpoint would rank; "
                f"use one of: {', '.join(RANKED_METRICS)}"
            )
        better = RANKED_METRICS[self.metric]
        if better is not None and better != self.higher_is_better:
            raise ConfigError(
                f"checkpoint.higher_is_better={str(self.higher_is_better).lower()} keeps the worst "
                f"checkpoints by checkpoint.metric={self.metric}: set checkpoint.higher_is_better="
                f"{str(better).lower()}"
            )


@dataclass
class LoggerConfig:
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "hpcrl"
    wandb_mode: str = "offline"
    """'offline' works without network; 'online' needs WANDB_API_KEY in the environment."""
    val_samples: int = 4
    """Validation problems shown per validation (prompt, completion, answer, outcome) in
    ``samples.jsonl`` and TensorBoard's text tab, to read how the answers change; 0: none."""

    def check(self) -> None:
        if self.wandb_mode not in ("offline", "online", "disabled"):
            raise ConfigError(f"logger.wandb_mode='{self.wandb_mode}' must be offline, online or disabled")
        if self.wandb_mode == "online" and not self.wandb:
            raise ConfigError(
                "logger.wandb_mode=online does nothing with logger.wandb=false: set logger.wandb=true, "
                "or drop logger.wandb_mode"
            )


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
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    """Multi-turn episodes with an environment (hpcrl/envs/config.py); off by default."""
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    run: RunMeta = field(default_factory=RunMeta)
    eval: EvalConfig = field(default_factory=EvalConfig)
    """``hpcrl eval`` only (hpcrl/config/eval.py)."""

    def check(self) -> None:
        """Per-component value checks; cross-component rules live in the topology and quirks."""
        parts = (
            self.cluster,
            self.model,
            self.algo,
            self.trainer,
            self.rollout,
            self.data,
            self.rewards,
            self.env,
            self.eval,
        )
        for part in parts:
            part.check()
        if gap := optimizer_gap(self.trainer):
            raise ConfigError(gap)
        self.env.check_episodes(self.trainer.router_replay, self.data.image_field, self.algo.overlong_buffer)
        self.env.check_nodes(self.cluster.scheduler.value, self.cluster.env_node is not None)
        positive("layout.train_nodes", self.layout.train_nodes)
        if self.layout.rollout_nodes < 0:
            raise ConfigError(
                f"layout.rollout_nodes={self.layout.rollout_nodes} must be >= 0 (0 = colocated)"
            )
        if not sends_logprobs(self.rollout) and self.algo.is_correction.value != "none":
            raise ConfigError(
                f"rollout.logprobs=false leaves algo.is_correction={self.algo.is_correction.value} without "
                "the engine's log-probs: set rollout.logprobs=true or algo.is_correction=none"
            )
        fraction = sampling.logprob_fraction if (sampling := logprob_sampling(self.rollout)) else None
        if fraction is not None and fraction < 1 and self.algo.is_correction.value != "none":
            raise ConfigError(
                f"rollout.logprob_fraction={fraction} leaves algo.is_correction={self.algo.is_correction.value} "
                "without the engine's log-probs of most completions: drop it (null) or set it to 1"
            )
        if self.algo.max_staleness and self.algo.is_correction.value == "none":
            raise ConfigError(
                f"algo.max_staleness={self.algo.max_staleness} trains on samples of older policies, which "
                "needs an importance correction against the engine's log-probs: set algo.is_correction=tis "
                "(or icepop), or algo.max_staleness=0"
            )
        if inflight_updates(self.rollout) and not self.algo.max_staleness:
            raise ConfigError(
                "rollout.inflight_update=true swaps weights under a generation running beside training, "
                "which only algo.max_staleness >= 1 has: set algo.max_staleness=1 or drop it"
            )
        check_run(self.data, self.model, self.trainer)
        if self.data.image_field:
            self.check_images(self.data.image_field)
        self.checkpoint.check()
        self.logger.check()

    def check_images(self, key: str) -> None:
        """An image data set needs an engine and a trainer that take images, with the vision tower."""
        if not rollout_spec(self.rollout).images:
            raise ConfigError(
                f"data.image_field={key}: rollout={self.rollout.backend} generates from text only; use rollout=vllm"
            )
        if not trainer_spec(self.trainer).images:
            raise ConfigError(
                f"data.image_field={key}: trainer={self.trainer.backend} trains on text only; use trainer=fsdp"
            )
        if (served := served_weights(self.rollout)) and served.language_model_only:
            raise ConfigError(
                f"data.image_field={key} sends images, and rollout.language_model_only=true serves the model "
                "without its vision tower: set rollout.language_model_only=false"
            )
        if self.trainer.cp > 1:
            raise ConfigError(
                f"data.image_field={key}: trainer.cp={self.trainer.cp} splits token ids only, not the images "
                "their tokens come from; set trainer.cp=1"
            )

    @property
    def max_seq_len(self) -> int:
        """Prompt and completion: a multi-turn episode's completion is all its turns (``env.max_tokens``)."""
        completion = self.env.max_tokens if self.env.enabled else self.rollout.max_new_tokens
        return self.trainer.max_seq_len or self.data.max_prompt_tokens + completion


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
