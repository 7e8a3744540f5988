"""The judge engines in the plan (``rewards.judge``): an engine group like the rollout engines, but
frozen (served once, never refit), on the run's machine (a CPU run) or on nodes of their own. Sized
here: their GPUs and nodes, each engine's weights and KV cache against its share of a GPU; what does
not fit is refused in one line before anything is submitted."""

from __future__ import annotations

from dataclasses import dataclass

from hpcrl.config.catalog import catalog_model
from hpcrl.config.cluster import Scheduler
from hpcrl.config.model import ModelConfig
from hpcrl.config.schema import RunConfig
from hpcrl.errors import ConfigError
from hpcrl.rewards.config import JudgeConfig

GB = 1e9
TEMPLATE_ROOM = 512
"""Judge tokens beyond the run's prompt and completion (``max_seq_len``) that ``rewards.judge.max_model_len``
None leaves for the template's own text and the reference (another tokenizer may count more)."""
WEIGHT_BYTES = 2
"""bf16 weights on GPUs (the CPU engine runs fp32: ``cpu_kv_gb`` doubles the KV, the weights are small)."""


@dataclass(frozen=True)
class JudgePlan:
    settings: JudgeConfig
    model: ModelConfig
    nodes: int
    """Nodes of the judges' own (0: the run's machine)."""
    gpus: int
    """GPUs the judge engines hold (0: a CPU run)."""
    max_model_len: int
    weights_gb: float
    """One engine GPU's part of the judge's weights."""
    kv_per_sequence_gb: float
    budget_gb: float
    """One engine GPU's share (``rewards.judge.gpu_memory_utilization`` of its memory; 0 on the CPU)."""

    @property
    def sequences_that_fit(self) -> int:
        return max(0, int((self.budget_gb - self.weights_gb) // self.kv_per_sequence_gb))

    def cpu_kv_gb(self) -> float:
        """The CPU engine's explicit KV budget: ``max_num_seqs`` sequences in fp32 (twice bf16's bytes)."""
        return max(0.05, 2 * self.settings.max_num_seqs * self.kv_per_sequence_gb)

    def line(self) -> str:
        """``hpcrl plan``'s judge row: the engines, where they run, their memory."""
        s = self.settings
        where = f"{self.nodes} node(s) of their own" if self.nodes else "the run's machine"
        memory = (
            f"{self.weights_gb:.2f} GB weights + KV for {self.sequences_that_fit} sequences of "
            f"{self.max_model_len} tokens in {self.budget_gb:.1f} GB per GPU"
            if self.gpus
            else f"{self.cpu_kv_gb():.2f} GB KV on the CPU"
        )
        return (
            f"{s.engines} x {self.model.name} (tp {s.tp}, frozen) on {where}, {self.gpus} GPU(s); "
            f"{memory}; weight {s.weight:g}, parse {s.parse}"
        )


def plan_judge(cfg: RunConfig, on_gpus: bool) -> JudgePlan | None:
    """The judges' plan (None: no ``rewards.judge``); ConfigError when they do not fit."""
    s = cfg.rewards.judge
    if cfg.cluster.judge_node is not None and (s is None or not s.nodes):
        raise ConfigError(
            "cluster.judge_node describes judge nodes, and this run has none: set rewards.judge.nodes >= 1, "
            "or remove cluster.judge_node"
        )
    if s is None:
        return None
    model = catalog_model(s.model, "rewards.judge.model")
    length = s.max_model_len or min(
        model.max_position_embeddings, cfg.max_seq_len + TEMPLATE_ROOM + s.max_new_tokens
    )
    if length > model.max_position_embeddings:
        raise ConfigError(
            f"rewards.judge.max_model_len={length} is past {model.name}'s {model.max_position_embeddings} "
            f"positions: set it <= {model.max_position_embeddings} (or null)"
        )
    if length <= s.max_new_tokens:
        raise ConfigError(
            f"the judge's {length} tokens leave no room for a prompt before rewards.judge.max_new_tokens="
            f"{s.max_new_tokens}: lower it"
        )
    kv = model.kv_bytes_for_sequence(length, tp=s.tp) / GB
    if not on_gpus:
        return JudgePlan(s, model, _nodes(cfg, s, 0), 0, length, 0.0, kv, 0.0)
    gpn = judge_node_gpus(cfg)
    if s.tp > gpn or gpn % s.tp:
        raise ConfigError(
            f"rewards.judge.tp={s.tp} must divide a judge node's {gpn} GPUs ({_gpus_key(cfg)}; "
            "one engine within a node)"
        )
    gpus = s.engines * s.tp
    if s.nodes == 0:
        raise ConfigError(
            f"rewards.judge.nodes=0 shares the run's GPUs, which the trainer ranks and rollout engines "
            f"hold: give the {gpus} judge GPU(s) nodes of their own, rewards.judge.nodes={-(-gpus // gpn)}"
        )
    nodes = _nodes(cfg, s, gpus)
    capacity = judge_memory_gb(cfg)
    weights = model.param_counts().total * WEIGHT_BYTES / s.tp / GB
    plan = JudgePlan(s, model, nodes, gpus, length, weights, kv, capacity * s.gpu_memory_utilization)
    if plan.sequences_that_fit < 1:
        raise ConfigError(
            f"a judge engine's share ({plan.budget_gb:.1f} GB of {capacity:.0f} GB) cannot hold {model.name}'s "
            f"weights ({weights:.1f} GB per GPU) and one {length}-token sequence: raise "
            "rewards.judge.tp or rewards.judge.gpu_memory_utilization"
        )
    return plan


def _nodes(cfg: RunConfig, s: JudgeConfig, gpus: int) -> int:
    """``rewards.judge.nodes``, checked against the machine (a local run has one) and the engines' GPUs."""
    if s.nodes and cfg.cluster.scheduler is Scheduler.local:
        raise ConfigError(
            f"rewards.judge.nodes={s.nodes}: a local run has one machine, which the judges share: "
            "set rewards.judge.nodes=0"
        )
    gpn = judge_node_gpus(cfg)
    have = s.nodes * gpn
    if gpus > have:
        raise ConfigError(
            f"{s.engines} judge engine(s) of rewards.judge.tp={s.tp} need {gpus} GPUs; rewards.judge.nodes="
            f"{s.nodes} gives {have}: set rewards.judge.nodes={-(-gpus // gpn)}"
        )
    return s.nodes


def judge_node_gpus(cfg: RunConfig) -> int:
    """GPUs of one judge node: its kind's own (``cluster.judge_node.gpus_per_node``), else a training node's."""
    node = cfg.cluster.judge_node
    own = node.gpus_per_node if node is not None else None
    return cfg.cluster.gpus_per_node if own is None else own


def judge_memory_gb(cfg: RunConfig) -> float:
    """Memory of one judge GPU: its kind's own (``cluster.judge_node.gpu_memory_gb``), else a training GPU's."""
    node = cfg.cluster.judge_node
    own = node.gpu_memory_gb if node is not None else None
    return cfg.cluster.gpu_memory_gb if own is None else own


def _gpus_key(cfg: RunConfig) -> str:
    node = cfg.cluster.judge_node
    own = node is not None and node.gpus_per_node is not None
    return "cluster.judge_node.gpus_per_node" if own else "cluster.gpus_per_node"
