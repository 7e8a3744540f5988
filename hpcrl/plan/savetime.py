"""How long one checkpoint takes to write, from the plan: what a scheduler's grace period must cover.

A plain ``scancel`` (SIGTERM, then SIGKILL after Slurm's ``KillWait``) and a Kubernetes pod deletion
(``terminationGracePeriodSeconds``) both give the job a fixed time to save after the current step; the
submit checks compare that time with this estimate."""

from __future__ import annotations

from dataclasses import dataclass

from hpcrl.plan.planner import Plan
from hpcrl.trainer.backends import trainer_spec

GB = 1e9
SAVE_OVERHEAD_S = 15.0
"""Fixed cost of a save beside the bytes: gathering shard metadata, fsync, checksums, the commit rename."""


@dataclass(frozen=True)
class SaveTime:
    gb: float
    """One checkpoint: weights and optimizer state of every trainer rank."""
    writers: int
    """Trainer nodes writing their shards at once."""
    gbps: float
    """``cluster.checkpoint_write_gbps``: each node's sustained write rate."""

    @property
    def seconds(self) -> float:
        return SAVE_OVERHEAD_S + self.gb / (self.gbps * self.writers)

    def line(self) -> str:
        return (
            f"checkpoint: {self.gb:.1f} GB, saved in ~{self.seconds:.0f} s by {self.writers} node(s) at "
            f"{self.gbps:g} GB/s each (cluster.checkpoint_write_gbps)"
        )


def checkpoint_gb(plan: Plan) -> float:
    """One checkpoint's size: the trainer's weights and optimizer state (the backend's bytes per
    parameter: ``TrainerSpec.checkpoint_bytes``)."""
    per_param = trainer_spec(plan.cfg.trainer).checkpoint_bytes(plan.cfg.model, plan.cfg.trainer)
    return per_param * plan.cfg.model.param_counts().total / GB


def save_time(plan: Plan) -> SaveTime:
    return SaveTime(checkpoint_gb(plan), plan.topology.train_nodes, plan.cfg.cluster.checkpoint_write_gbps)


def save_seconds(plan: Plan) -> float:
    """Seconds one save takes after the current step ends (estimate: bytes over the nodes' write rate,
    plus a fixed overhead)."""
    return save_time(plan).seconds
