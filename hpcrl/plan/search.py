"""Auto layout: the placements that fit the cluster's memory, fewest GPUs first, then the cheapest step.

The search walks node counts upwards. At each count it tries colocated (every node trains and
generates) and every split (r rollout nodes + the rest training); for each side the parallel degrees
the backend can build (trainer TP/PP/CP/EP, activation recompute as the one memory lever beyond
them, rollout TP and so the engines). Memory is the planner's own estimate (``plan/memory.py``) on
the planner's own ``Topology``; the two sides of a split are independent, so each side is estimated
once per node count and combined. A node count is skipped at the cost of one estimate when even its
most parallel layout (the least state per GPU) does not fit. It stops one node count after the first
that fits, so the runners-up include one layout with more nodes.

The layouts it returns and their nominal step: ``layout.py``.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from hpcrl.config.cluster import Scheduler
from hpcrl.config.schema import RunConfig
from hpcrl.core.checks import divisors
from hpcrl.core.parallel import TrainParallel
from hpcrl.errors import ConfigError, DoesNotFitError
from hpcrl.plan.layout import (
    Layout,
    LayoutSearch,
    Scored,
    TrainChoice,
    build_short,
    rollout_short,
    step_seconds,
    train_short,
)
from hpcrl.plan.memory import (
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
from hpcrl.rollout.backends import sleep_mode
from hpcrl.trainer.backends import Degrees, trainer_spec

SEARCH_MAX_NODES = 128
"""Where the search gives up on clusters without ``cluster.max_nodes``."""


class Search:
    """One search over one config (quirks applied to a private copy: they change memory terms)."""

    def __init__(self, cfg: RunConfig, fixed: frozenset[str] = frozenset()) -> None:
        self.fixed = fixed
        """Layout keys typed on the command line: searched only at their typed value."""
        self.cfg = copy.deepcopy(cfg)
        apply_quirks(self.cfg)
        self.cluster = self.cfg.cluster
        self.gpn = self.cluster.gpus_per_node
        self.rollout_gpn = self.cluster.rollout_node_gpus()
        """A dedicated rollout node's own GPUs (None: ``gpn``); with ``cluster.rollout_node`` set, only
        split layouts are searched (a colocated one is refused) and the rollout side is sized on them."""
        self.capacity = self.cluster.gpu_memory_gb
        self.tried = 0
        self._train: dict[int, list[tuple[TrainChoice, TrainMemory, Topology]]] = {}
        self._rollout: dict[int, list[tuple[int, RolloutMemory]]] = {}
        self.short: dict[str, str] = {}
        """Per side (training, rollout, colocated), why the last layout tried there did not fit: the
        one line when nothing does."""

    # -- the space ---------------------------------------------------------------------------------
    def options(self, key: str, searched: list[Any]) -> list[Any]:
        """``searched``, or only the configured value of a key typed on the command line."""
        if key not in self.fixed:
            return searched
        node: Any = self.cfg
        for part in key.split("."):
            node = getattr(node, part)
        return [node]

    @functools.cached_property
    def choices(self) -> list[tuple[Degrees, bool]]:
        """The training side's space, least parallel first: the backend's degrees (any node count) and
        recompute (computed once a search)."""
        return self.train_choices()

    def train_choices(self) -> list[tuple[Degrees, bool]]:
        cfg, model, trainer = self.cfg, self.cfg.model, self.cfg.trainer
        recompute = self.options(
            "trainer.activation_checkpointing", sorted({trainer.activation_checkpointing, True})
        )
        space = trainer_spec(trainer).choices(model, trainer, self.gpn, cfg.max_seq_len, self.options)
        return [(d, r) for d in space for r in recompute]

    def rollout_tps(self) -> list[int]:
        heads = self.cfg.model.num_attention_heads
        return self.options(
            "rollout.tp", [t for t in divisors(self.rollout_gpn or self.gpn) if heads % t == 0]
        )

    # -- one side at a time --------------------------------------------------------------------------
    def train_side(self, nodes: int) -> list[tuple[TrainChoice, TrainMemory, Topology]]:
        """Training layouts on ``nodes`` nodes whose training alone fits, memoised per node count."""
        if nodes in self._train:
            return self._train[nodes]
        choices = self.choices
        fitting: list[tuple[TrainChoice, TrainMemory, Topology]] = []
        if not choices:
            self.short["training"] = build_short(self.cfg)
            self._train[nodes] = fitting
            return fitting
        nearest: TrainMemory | None = None
        # the most parallel choice holds the least per GPU: if it does not fit, none does
        last = len(choices) - 1
        for i in [last, *range(last)]:
            got = self.estimate_train(nodes, *choices[i])
            if got is None:
                continue
            choice, memory, topo = got
            if memory.peak <= self.capacity and memory.startup <= self.capacity:
                fitting.append((choice, memory, topo))
                continue
            if nearest is None or max(memory.peak, memory.startup) < max(nearest.peak, nearest.startup):
                nearest = memory
            if i == last:
                break
        if not fitting and nearest is not None:
            self.short["training"] = train_short(nearest, nodes, self.capacity)
        self._train[nodes] = fitting
        return fitting

    def estimate_train(
        self, nodes: int, space: Degrees, recompute: bool
    ) -> tuple[TrainChoice, TrainMemory, Topology] | None:
        """The degrees ``space`` on ``nodes`` nodes as the record (None: they do not divide its GPUs),
        and its memory; the config stays as given."""
        try:
            train = TrainParallel(nodes * self.gpn, *space)
        except ConfigError:
            return None
        topo = build_topology(gpus_per_node=self.gpn, train=train, rollout_nodes=0, rollout_tp=1)
        self.tried += 1
        return TrainChoice(train, recompute), estimate_train(self.cfg, topo, recompute=recompute), topo

    def rollout_side(self, nodes: int) -> list[tuple[int, RolloutMemory]]:
        """(rollout TP, memory) of engines on ``nodes`` nodes that hold their weights and a sequence."""
        if nodes not in self._rollout:
            fitting, missed = [], ""
            for tp in self.rollout_tps():
                memory = self.estimate_rollout(nodes, tp)
                if memory.sequences_that_fit >= 1:
                    fitting.append((tp, memory))
                else:
                    missed = rollout_short(memory, tp, self.rollout_gpn or self.gpn)  # the largest tp's, last
            if not fitting and missed:
                self.short["rollout"] = missed
            self._rollout[nodes] = fitting
        return self._rollout[nodes]

    def estimate_rollout(self, nodes: int, tp: int) -> RolloutMemory:
        if self.cluster.rollout_node is not None:  # split only: the rollout nodes' own GPUs and memory
            train = TrainParallel(self.gpn)
            topo = build_topology(
                gpus_per_node=self.gpn,
                train=train,
                rollout_nodes=nodes,
                rollout_tp=tp,
                rollout_node_gpus=self.rollout_gpn,
            )
        else:
            train = TrainParallel(nodes * self.gpn)
            topo = build_topology(gpus_per_node=self.gpn, train=train, rollout_nodes=0, rollout_tp=tp)
        self.tried += 1
        return estimate_rollout(self.cfg, topo)

    # -- whole layouts -------------------------------------------------------------------------------
    def sleep(self) -> bool:
        mode = sleep_mode(self.cfg.rollout)
        if mode is None:  # the engine has no sleep mode
            return False
        return mode.sleep if mode.sleep is not None else on_gpus(self.cluster)

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
        if (mode := sleep_mode(self.cfg.rollout)) is not None and mode.sleep:
            return  # an explicit rollout.sleep=true asks for colocated engines
        for rollout_tp, memory in self.rollout_side(rollout_nodes):
            for choice, train, _ in self.train_side(train_nodes):
                topo = build_topology(
                    gpus_per_node=self.gpn,
                    train=choice.train,
                    rollout_nodes=rollout_nodes,
                    rollout_tp=rollout_tp,
                    rollout_node_gpus=self.rollout_gpn,
                )
                if scored := self.score(choice, topo, train, memory, max(train.peak, memory.budget)):
                    yield scored

    def score(
        self, c: TrainChoice, topo: Topology, train: TrainMemory, rollout: RolloutMemory, peak: float
    ) -> Scored | None:
        placeable, segment = self.segment(topo)
        if not placeable:
            return None
        layout = Layout(topo.train_nodes, topo.rollout_nodes, c.train, c.recompute, topo.rollout.tp, segment)
        step = step_seconds(self.cfg, topo, c.recompute, rollout)
        return Scored(layout, topo.total_gpus, peak, step, topo.rollout.engines)

    def segment(self, topo: Topology) -> tuple[bool, int | None]:
        """Whether the layout can be placed, and the segment it submits with: on NVLink-domain clusters
        the largest that keeps its TP and expert groups in one domain, elsewhere the configured one."""
        domain, configured = self.cluster.nvlink_domain_nodes, self.cluster.slurm.segment
        if domain > 1 and "cluster.slurm.segment" not in self.fixed:
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
        if not self.choices:
            self.short["training"] = build_short(self.cfg)
            return found
        train, rollout = (self.options(f"layout.{k}_nodes", [None])[0] for k in ("train", "rollout"))
        for nodes in range(1, self.max_nodes() + 1):
            for rollout_nodes in range(nodes):
                if train not in (None, nodes - rollout_nodes) or rollout not in (None, rollout_nodes):
                    continue
                if rollout_nodes:
                    found += self.split(rollout_nodes, nodes - rollout_nodes)
                elif self.cluster.rollout_node is None:  # dedicated rollout nodes are split only
                    found += self.colocated(nodes)
            if found and first is None:
                first = nodes
            if first is not None and nodes > first:
                break
        return sorted(found, key=Scored.key)


def search_layouts(cfg: RunConfig, reason: str, fixed: frozenset[str] = frozenset()) -> LayoutSearch:
    """The best fitting layout and up to four runners-up; DoesNotFitError in one line if none fits.
    ``fixed``: layout keys (``layout.LAYOUT_KEYS``) kept at their configured value."""
    search = Search(cfg, fixed)
    found = search.run()
    if not found:
        short = "; ".join(search.short.values()) or "no layout the backend can build"
        raise DoesNotFitError(
            f"{cfg.model.name} fits no layout on {cfg.cluster.name} ({search.gpn} x {search.capacity:.0f} GB "
            f"per node, up to {search.max_nodes()} node(s)) with trainer={cfg.trainer.backend}"
            f"{', keeping ' + ' '.join(sorted(fixed)) + ' as typed' if fixed else ''}: {short}"
        )
    return LayoutSearch(reason, found[0], tuple(found[1:5]), search.tried)
