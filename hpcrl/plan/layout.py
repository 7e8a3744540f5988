"""A layout the auto layout search found (``search.py``): its keys, its score, and how it is shown.

``step_seconds`` only ranks layouts of one model on one cluster: nominal efficiencies, not a forecast.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hpcrl.config.schema import RunConfig
from hpcrl.core.parallel import TrainParallel
from hpcrl.plan.memory import GB, RolloutMemory, TrainMemory
from hpcrl.plan.topology import Placement, Topology
from hpcrl.trainer.backends import expert_tp_view, trainer_spec

LAYOUT_KEYS = (
    "layout.train_nodes",
    "layout.rollout_nodes",
    "trainer.tp",
    "trainer.pp",
    "trainer.cp",
    "trainer.ep",
    "trainer.expert_tp",
    "trainer.activation_checkpointing",
    "rollout.tp",
    "cluster.slurm.segment",
)
"""The keys a layout sets. Those typed on the command line stay as typed: the search finds the rest."""
TRAIN_MFU = 0.35
DECODE_BYTES_PER_S = 4e12
"""Nominal HBM bandwidth per GPU: decoding reads the weights and the KV cache once per token."""
REFIT_BYTES_PER_S = 25e9
"""Nominal trainer -> engine bandwidth of a split refit (across nodes)."""


@dataclass(frozen=True)
class Layout:
    """Every key a layout sets: the nodes of each side, the training degrees as their one record
    (``train``, over ``train_nodes`` nodes), recompute, the engines' tensor parallel size and the
    segment (None: the configured one). The planner builds the plan's ``Topology`` and memory estimate
    from it and writes it into the job's config (``apply``); ``overrides`` types it back as a command
    line; ``configured`` reads a config's own."""

    train_nodes: int
    rollout_nodes: int
    train: TrainParallel
    recompute: bool
    rollout_tp: int
    segment: int | None = None

    def overrides(self) -> list[str]:
        par = self.train
        keys = [
            f"layout.train_nodes={self.train_nodes}",
            f"layout.rollout_nodes={self.rollout_nodes}",
            f"trainer.tp={par.tp}",
            f"trainer.pp={par.pp}",
            f"trainer.cp={par.cp}",
            f"trainer.ep={par.ep}",
            f"trainer.activation_checkpointing={str(self.recompute).lower()}",
            f"rollout.tp={self.rollout_tp}",
        ]
        if par.expert_tp > 1:  # a megatron key: fsdp's schema has no expert_tp
            keys.append(f"trainer.expert_tp={par.expert_tp}")
        if self.segment is not None:
            keys.append(f"cluster.slurm.segment={self.segment}")
        return keys

    @classmethod
    def configured(cls, cfg: RunConfig) -> Layout:
        """The config's own layout (what ``apply`` would write back unchanged); raises ConfigError where
        its training degrees do not divide its training GPUs."""
        train_nodes, trainer = cfg.layout.train_nodes, cfg.trainer
        train = trainer.parallel(train_nodes * cfg.cluster.gpus_per_node)
        recompute = trainer.activation_checkpointing
        return cls(train_nodes, cfg.layout.rollout_nodes, train, recompute, cfg.rollout.tp)

    def apply(self, cfg: RunConfig) -> None:
        """Write this layout into ``cfg`` (in place): the job's config says what its plan runs, and the
        keys the run reads there (the engines' ``rollout.tp``, the trainers' recompute, the sbatch's
        segment) are the plan's. Only the planner calls it, on the job's copy, once the search is done:
        the search and the memory estimate read the record, never a config written for them."""
        cfg.layout.train_nodes, cfg.layout.rollout_nodes = self.train_nodes, self.rollout_nodes
        trainer, par = cfg.trainer, self.train
        trainer.tp, trainer.pp, trainer.cp, trainer.ep = par.tp, par.pp, par.cp, par.ep
        trainer.activation_checkpointing = self.recompute
        if (experts := expert_tp_view(trainer)) is not None:
            experts.expert_tp = par.expert_tp
        cfg.rollout.tp = self.rollout_tp
        if self.segment is not None:
            cfg.cluster.slurm.segment = self.segment

    @property
    def nodes(self) -> int:
        return self.train_nodes + self.rollout_nodes


@dataclass(frozen=True)
class Scored:
    layout: Layout
    gpus: int
    peak_gb: float
    """The largest per-GPU peak of the layout (training or rollout GPUs)."""
    step_s: float
    engines: int
    """The rollout engines (on the rollout nodes' own GPUs where their kind has its own count)."""

    def key(self) -> tuple[int, float]:
        return self.gpus, self.step_s

    def describe(self) -> tuple[str, str, str, str, str]:
        """Nodes, train parallelism, rollout engines, GPUs and peak, nominal step: one row."""
        layout = self.layout
        nodes = (
            f"{layout.rollout_nodes} + {layout.train_nodes} split"
            if layout.rollout_nodes
            else f"{layout.train_nodes} colocated"
        )
        par = layout.train
        train = f"TP{par.tp} PP{par.pp} CP{par.cp} EP{par.ep}"
        if par.expert_tp > 1:
            train += f" ETP{par.expert_tp}"
        train += ", recompute" if layout.recompute else ""
        return (
            nodes + (f" (segment {layout.segment})" if layout.segment else ""),
            train,
            f"{self.engines} x TP{layout.rollout_tp}",
            f"{self.gpus} / {self.peak_gb:.0f} GB",
            f"{self.step_s:.0f} s",
        )


@dataclass(frozen=True)
class LayoutSearch:
    """What ``hpcrl plan`` prints about an auto layout."""

    reason: str
    chosen: Scored
    runners_up: tuple[Scored, ...]
    tried: int
    """Layouts whose memory was estimated."""

    def summary(self) -> str:
        """One line for render/submit (``hpcrl plan`` shows the whole search)."""
        nodes, train, engines, gpus, _ = self.chosen.describe()
        return f"layout  auto: {nodes}, train {train}, rollout {engines}, {gpus} ({self.reason})"


@dataclass(frozen=True)
class TrainChoice:
    """One training layout the search estimated: the degree record on its node count, and recompute."""

    train: TrainParallel
    recompute: bool


def build_short(cfg: RunConfig) -> str:
    trainer = cfg.trainer
    gap = trainer_spec(trainer).model_gap(cfg.model)
    return gap or f"trainer={trainer.backend} has no parallel layout it can build for {cfg.model.name}"


def train_short(memory: TrainMemory, nodes: int, capacity: float) -> str:
    need = max(memory.peak, memory.startup)
    return (
        f"training needs {need:.0f} GB per GPU of {capacity:.0f} GB at best on {nodes} node(s) (activations {memory.activations:.0f} GB, weights + optimizer "
        f"{memory.weights + memory.optimizer:.0f} GB)"
    )


def rollout_short(memory: RolloutMemory, tp: int, gpus_per_node: int) -> str:
    top = "" if tp < gpus_per_node else f" (an engine spans at most one node: rollout.tp <= {gpus_per_node})"
    return (
        f"a rollout engine at rollout.tp={tp}{top} has {memory.budget:.0f} GB per GPU for its "
        f"weights ({memory.weights:.0f} GB) and one {memory.sequence_len}-token sequence"
    )


def step_seconds(cfg: RunConfig, topo: Topology, recompute: bool, rollout: RolloutMemory) -> float:
    """A nominal step (generate + train + refit) to rank layouts by: compute-bound training with a
    penalty per parallel degree and the pipeline bubble, bandwidth-bound decoding in waves of what the
    KV cache holds, and the refit's transfer when the engines are on other nodes."""
    model, algo, par = cfg.model, cfg.algo, topo.train
    samples = algo.samples_per_step
    tokens = samples * cfg.max_seq_len
    active = model.param_counts().active
    flops = 6 * active * tokens * (4 / 3 if recompute else 1)
    micro_batches = max(1, samples // max(1, par.dp * (cfg.trainer.micro_batch_size or 1)))
    bubble = (par.pp - 1) / (micro_batches + par.pp - 1)
    comm = 1 + 0.1 * math.log2(par.tp * par.cp * par.pp) + 0.05 * math.log2(par.ep)
    peak_flops = max(cfg.cluster.gpu_bf16_tflops, 1.0) * 1e12
    train_s = flops / (par.world * peak_flops * TRAIN_MFU / comm * (1 - bubble))
    per_engine = -(-samples // topo.rollout.engines)
    concurrent = max(1, min(per_engine, cfg.rollout.max_num_seqs, rollout.sequences_that_fit))
    waves = -(-per_engine // concurrent)
    bytes_per_token = (rollout.weights + concurrent * rollout.kv_per_sequence) * GB
    latency = bytes_per_token / DECODE_BYTES_PER_S * (1 + 0.1 * (topo.rollout.tp - 1))
    rollout_s = waves * cfg.rollout.max_new_tokens * latency
    refit_s = 2 * model.param_counts().total / REFIT_BYTES_PER_S if topo.placement is Placement.SPLIT else 0.0
    return train_s + rollout_s + refit_s


def typed_layout_keys(overrides: list[str]) -> frozenset[str]:
    """The layout keys an override list sets (``trainer.ep=8``, ``+layout.rollout_nodes=1``)."""
    from hpcrl.config.compose import command_line_keys

    return frozenset(command_line_keys([o for o in overrides if "=" in o]) & set(LAYOUT_KEYS))
