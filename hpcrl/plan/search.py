"""Auto layout: the placements that fit the cluster's memory, fewest GPUs first, then the cheapest step.

The search walks node counts upwards. At each count it tries colocated (every node trains and
generates) and every split (r rollout nodes + the rest training); for each side the parallel degrees
the backend can build (trainer TP/PP/CP/EP, activation recompute as the one memory lever beyond
them, rollout TP and so the engines). Memory is the planner's own estimate (``plan/memory.py``) on
the planner's own ``Topology``; the two sides of a split are independent, so each side is estimated
once per node count and combined. A node count is skipped at the cost of one estimate when even its
most parallel layout (the least state per GPU) does not fit. It stops one node count after the first
that fits, so the runners-up include one layout with more nodes.

``step_seconds`` only ranks layouts of one model on one cluster: nominal efficiencies, not a forecast.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

from hpcrl.config.checks import divisors
from hpcrl.config.cluster import Scheduler
from hpcrl.config.schema import RunConfig
from hpcrl.errors import ConfigError, DoesNotFitError
from hpcrl.plan.memory import (
    GB,
    MemoryEstimate,
    RolloutMemory,
    TrainMemory,
    colocated_peaks,
    estimate_rollout,
    estimate_train,
)
from hpcrl.plan.nvlink import check_nvlink, segment_for
from hpcrl.plan.quirks import apply_quirks
from hpcrl.plan.topology import Placement, Topology, build_topology, on_gpus
from hpcrl.rollout.config import VLLMRolloutConfig
from hpcrl.trainer.config import FSDPTrainerConfig, MegatronTrainerConfig, megatron_build_gap

SEARCH_MAX_NODES = 128
"""Where the search gives up on clusters without ``cluster.max_nodes``."""
TRAIN_MFU = 0.35
DECODE_BYTES_PER_S = 4e12
"""Nominal HBM bandwidth per GPU: decoding reads the weights and the KV cache once per token."""
REFIT_BYTES_PER_S = 25e9
"""Nominal trainer -> engine bandwidth of a split refit (across nodes)."""


@dataclass(frozen=True)
class Layout:
    """Every key a layout sets; ``overrides`` types it back as a command line."""

    train_nodes: int
    rollout_nodes: int
    tp: int
    pp: int
    cp: int
    ep: int
    expert_tp: int
    recompute: bool
    rollout_tp: int
    segment: int | None = None

    def overrides(self) -> list[str]:
        keys = [
            f"layout.train_nodes={self.train_nodes}",
            f"layout.rollout_nodes={self.rollout_nodes}",
            f"trainer.tp={self.tp}",
            f"trainer.pp={self.pp}",
            f"trainer.cp={self.cp}",
            f"trainer.ep={self.ep}",
            f"trainer.activation_checkpointing={str(self.recompute).lower()}",
            f"rollout.tp={self.rollout_tp}",
        ]
        if self.segment is not None:
            keys.append(f"cluster.slurm.segment={self.segment}")
        return keys

    def apply(self, cfg: RunConfig) -> None:
        """Write this layout into ``cfg`` (in place)."""
        cfg.layout.train_nodes, cfg.layout.rollout_nodes = self.train_nodes, self.rollout_nodes
        trainer = cfg.trainer
        trainer.tp, trainer.pp, trainer.cp, trainer.ep = self.tp, self.pp, self.cp, self.ep
        trainer.activation_checkpointing = self.recompute
        if isinstance(trainer, MegatronTrainerConfig):
            trainer.expert_tp = self.expert_tp
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

    def key(self) -> tuple[int, float]:
        return self.gpus, self.step_s

    def describe(self) -> tuple[str, str, str, str, str]:
        """Nodes, train parallelism, rollout engines, GPUs and peak, nominal step: one row."""
        layout, gpus_per_node = self.layout, self.gpus // self.layout.nodes
        nodes = (
            f"{layout.rollout_nodes} + {layout.train_nodes} split"
            if layout.rollout_nodes
            else f"{layout.train_nodes} colocated"
        )
        train = f"TP{layout.tp} PP{layout.pp} CP{layout.cp} EP{layout.ep}"
        if layout.expert_tp > 1:
            train += f" ETP{layout.expert_tp}"
        train += ", recompute" if layout.recompute else ""
        engines = (layout.rollout_nodes or layout.train_nodes) * gpus_per_node // layout.rollout_tp
        return (
            nodes + (f" (segment {layout.segment})" if layout.segment else ""),
            train,
            f"{engines} x TP{layout.rollout_tp}",
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
    tp: int
    pp: int
    cp: int
    ep: int
    expert_tp: int
    recompute: bool


class Search:
    """One search over one config (quirks applied to a private copy: they change memory terms)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = copy.deepcopy(cfg)
        apply_quirks(self.cfg)
        self.cluster = self.cfg.cluster
        self.gpn = self.cluster.gpus_per_node
        self.capacity = self.cluster.gpu_memory_gb
        self.tried = 0
        self._train: dict[int, list[tuple[TrainChoice, TrainMemory, Topology]]] = {}
        self._rollout: dict[int, list[tuple[int, RolloutMemory]]] = {}
        self.short: dict[str, str] = {}
        """Per side (training, rollout, colocated), why the last layout tried there did not fit: the
        one line when nothing does."""

    # -- the space ---------------------------------------------------------------------------------
    def train_choices(self) -> list[TrainChoice]:
        cfg, model, trainer = self.cfg, self.cfg.model, self.cfg.trainer
        recompute = sorted({trainer.activation_checkpointing, True})
        if isinstance(trainer, FSDPTrainerConfig):  # no TP/CP/PP there (Plan.backend_gaps)
            return [TrainChoice(1, 1, 1, 1, 1, r) for r in recompute]
        assert isinstance(trainer, MegatronTrainerConfig)
        heads = model.num_attention_heads
        tps = [t for t in divisors(self.gpn) if heads % t == 0]
        pps = [p for p in (1, 2, 4, 8, 16) if model.num_layers % p == 0]
        cps = [c for c in (1, 2, 4, 8) if cfg.max_seq_len % c == 0]
        eps = [e for e in (1, 2, 4, 8, 16, 32, 64) if model.is_moe and model.num_experts % e == 0] or [1]
        out = []
        for tp in tps:
            if model.is_moe and tp > 1 and not trainer.sequence_parallel:
                continue  # MegatronTrainerConfig.moe_gap
            for pp in pps:
                for cp in cps:
                    if megatron_build_gap(model, tp, pp, cp):
                        continue
                    out += [
                        TrainChoice(tp, pp, cp, ep, trainer.expert_tp, r) for ep in eps for r in recompute
                    ]
        return out

    def rollout_tps(self) -> list[int]:
        heads = self.cfg.model.num_attention_heads
        return [t for t in divisors(self.gpn) if heads % t == 0]

    # -- one side at a time --------------------------------------------------------------------------
    def train_side(self, nodes: int) -> list[tuple[TrainChoice, TrainMemory, Topology]]:
        """Training layouts on ``nodes`` nodes whose training alone fits, memoised per node count."""
        if nodes in self._train:
            return self._train[nodes]
        choices = self.train_choices()
        fitting: list[tuple[TrainChoice, TrainMemory, Topology]] = []
        if not choices:
            self.short["training"] = build_short(self.cfg)
            self._train[nodes] = fitting
            return fitting
        # the most parallel choice holds the least per GPU: if it does not fit, none does
        for choice in [choices[-1], *choices[:-1]]:
            got = self.estimate_train(nodes, choice)
            if got is None:
                continue
            memory, topo = got
            if memory.peak <= self.capacity and memory.startup <= self.capacity:
                fitting.append((choice, memory, topo))
            elif choice is choices[-1]:
                self.short["training"] = train_short(memory, nodes, self.capacity)
                break
        self._train[nodes] = fitting
        return fitting

    def estimate_train(self, nodes: int, c: TrainChoice) -> tuple[TrainMemory, Topology] | None:
        try:
            topo = build_topology(
                gpus_per_node=self.gpn, train_nodes=nodes, rollout_nodes=0, tp=c.tp, pp=c.pp,
                cp=c.cp, ep=c.ep, expert_tp=c.expert_tp, rollout_tp=1,
            )  # fmt: skip
        except ConfigError:
            return None
        trainer = self.cfg.trainer
        trainer.tp, trainer.pp, trainer.cp, trainer.ep = c.tp, c.pp, c.cp, c.ep
        trainer.activation_checkpointing = c.recompute  # chunked_logprob() and activations read these
        self.tried += 1
        return estimate_train(self.cfg, topo), topo

    def rollout_side(self, nodes: int) -> list[tuple[int, RolloutMemory]]:
        """(rollout TP, memory) of engines on ``nodes`` nodes that hold their weights and a sequence."""
        if nodes not in self._rollout:
            fitting = []
            for tp in self.rollout_tps():
                memory = self.estimate_rollout(nodes, tp)
                if memory.sequences_that_fit >= 1:
                    fitting.append((tp, memory))
                else:
                    self.short["rollout"] = rollout_short(memory, tp, self.gpn)
            self._rollout[nodes] = fitting
        return self._rollout[nodes]

    def estimate_rollout(self, nodes: int, tp: int) -> RolloutMemory:
        topo = build_topology(
            gpus_per_node=self.gpn, train_nodes=nodes, rollout_nodes=0, tp=1, pp=1, cp=1, ep=1,
            expert_tp=1, rollout_tp=tp,
        )  # fmt: skip
        self.tried += 1
        return estimate_rollout(self.cfg, topo)

    # -- whole layouts -------------------------------------------------------------------------------
    def sleep(self) -> bool:
        rollout = self.cfg.rollout
        if not isinstance(rollout, VLLMRolloutConfig):
            return False
        return rollout.sleep if rollout.sleep is not None else on_gpus(self.cluster)

    def colocated(self, nodes: int) -> Iterator[Scored]:
        rollout_sides = self.rollout_side(nodes)
        for choice, train, topo in self.train_side(nodes):
            for rollout_tp, rollout in rollout_sides:
                phases = colocated_peaks(
                    train, rollout, sleep=self.sleep(), bucket_mb=self.cfg.rollout.weight_sync_bucket_mb
                )
                estimate = MemoryEstimate(self.capacity, Placement.COLOCATED, train, rollout, phases)
                if not estimate.fits:
                    self.short["colocated"] = "; ".join(estimate.problems)
                    continue
                full = replace(topo, rollout=replace(topo.rollout, tp=rollout_tp))
                if scored := self.score(choice, full, train, rollout, phases.peak):
                    yield scored

    def split(self, rollout_nodes: int, train_nodes: int) -> Iterator[Scored]:
        rollout = self.cfg.rollout
        if isinstance(rollout, VLLMRolloutConfig) and rollout.sleep:
            return  # an explicit rollout.sleep=true asks for colocated engines
        for rollout_tp, memory in self.rollout_side(rollout_nodes):
            for choice, train, _ in self.train_side(train_nodes):
                topo = build_topology(
                    gpus_per_node=self.gpn, train_nodes=train_nodes, rollout_nodes=rollout_nodes,
                    tp=choice.tp, pp=choice.pp, cp=choice.cp, ep=choice.ep, expert_tp=choice.expert_tp,
                    rollout_tp=rollout_tp,
                )  # fmt: skip
                if scored := self.score(choice, topo, train, memory, max(train.peak, memory.budget)):
                    yield scored

    def score(
        self, c: TrainChoice, topo: Topology, train: TrainMemory, rollout: RolloutMemory, peak: float
    ) -> Scored | None:
        placeable, segment = self.segment(topo)
        if not placeable:
            return None
        layout = Layout(
            topo.train_nodes, topo.rollout_nodes, c.tp, c.pp, c.cp, c.ep, c.expert_tp, c.recompute,
            topo.rollout.tp, segment,
        )  # fmt: skip
        return Scored(layout, topo.total_gpus, peak, step_seconds(self.cfg, topo, c, rollout))

    def segment(self, topo: Topology) -> tuple[bool, int | None]:
        """Whether the layout can be placed, and the segment it submits with: on NVLink-domain clusters
        the largest that keeps its TP and expert groups in one domain, elsewhere the configured one."""
        domain, configured = self.cluster.nvlink_domain_nodes, self.cluster.slurm.segment
        if domain > 1:
            segment = segment_for(topo, domain)
            return segment is not None, segment
        if configured is not None and topo.nodes % configured:
            return False, None
        return not check_nvlink(topo, domain, configured).problems, None

    def max_nodes(self) -> int:
        if self.cluster.scheduler is Scheduler.local:
            return 1
        return self.cluster.max_nodes or SEARCH_MAX_NODES

    def run(self) -> list[Scored]:
        """Every fitting layout of the smallest node count that has one and of the next, best first."""
        found: list[Scored] = []
        first = None
        if not self.train_choices():
            self.short["training"] = build_short(self.cfg)
            return found
        for nodes in range(1, self.max_nodes() + 1):
            found += self.colocated(nodes)
            for rollout_nodes in range(1, nodes):
                found += self.split(rollout_nodes, nodes - rollout_nodes)
            if found and first is None:
                first = nodes
            if first is not None and nodes > first:
                break
        return sorted(found, key=Scored.key)


def build_short(cfg: RunConfig) -> str:
    trainer = cfg.trainer
    gap = megatron_build_gap(cfg.model) if isinstance(trainer, MegatronTrainerConfig) else ""
    return gap or f"trainer={trainer.backend} has no parallel layout it can build for {cfg.model.name}"


def train_short(memory: TrainMemory, nodes: int, capacity: float) -> str:
    need = max(memory.peak, memory.startup)
    return (
        f"training needs {need:.0f} GB per GPU of {capacity:.0f} GB even at its most parallel layout "
        f"on {nodes} node(s) (activations {memory.activations:.0f} GB, weights + optimizer "
        f"{memory.weights + memory.optimizer:.0f} GB)"
    )


def rollout_short(memory: RolloutMemory, tp: int, gpus_per_node: int) -> str:
    top = "" if tp < gpus_per_node else f" (an engine spans at most one node: rollout.tp <= {gpus_per_node})"
    return (
        f"a rollout engine at rollout.tp={tp}{top} has {memory.budget:.0f} GB per GPU for its "
        f"weights ({memory.weights:.0f} GB) and one {memory.sequence_len}-token sequence"
    )


def step_seconds(cfg: RunConfig, topo: Topology, c: TrainChoice, rollout: RolloutMemory) -> float:
    """A nominal step (generate + train + refit) to rank layouts by: compute-bound training with a
    penalty per parallel degree and the pipeline bubble, bandwidth-bound decoding in waves of what the
    KV cache holds, and the refit's transfer when the engines are on other nodes."""
    model, algo, par = cfg.model, cfg.algo, topo.train
    samples = algo.num_prompts_per_step * algo.num_generations
    tokens = samples * cfg.max_seq_len
    active = model.param_counts().active
    flops = 6 * active * tokens * (4 / 3 if c.recompute else 1)
    micro_batches = max(1, samples // max(1, par.dp * cfg.trainer.micro_batch_size))
    bubble = (c.pp - 1) / (micro_batches + c.pp - 1)
    comm = 1 + 0.1 * math.log2(c.tp * c.cp * c.pp) + 0.05 * math.log2(c.ep)
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


def search_layouts(cfg: RunConfig, reason: str) -> LayoutSearch:
    """The best fitting layout and up to four runners-up; DoesNotFitError in one line if none fits."""
    search = Search(cfg)
    found = search.run()
    if not found:
        short = "; ".join(search.short.values()) or "no layout the backend can build"
        raise DoesNotFitError(
            f"{cfg.model.name} fits no layout on {cfg.cluster.name} up to {search.max_nodes()} node(s) of "
            f"{search.gpn} x {search.capacity:.0f} GB with trainer={cfg.trainer.backend}: {short}"
        )
    return LayoutSearch(reason, found[0], tuple(found[1:5]), search.tried)
