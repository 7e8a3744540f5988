"""The frozen topology value object: derived sizes and the errors it raises."""

from __future__ import annotations

import dataclasses

import pytest

from hpcrl.core.parallel import RolloutParallel, TrainParallel
from hpcrl.errors import ConfigError
from hpcrl.plan.topology import Placement, build_topology


def topo(*, gpus_per_node=8, train_nodes=2, rollout_nodes=0, rollout_tp=2, **degrees):
    train = TrainParallel(world=train_nodes * gpus_per_node, **{"tp": 2, **degrees})
    return build_topology(
        gpus_per_node=gpus_per_node, train=train, rollout_nodes=rollout_nodes, rollout_tp=rollout_tp
    )


def test_colocated_derivations():
    t = topo()
    assert t.placement is Placement.COLOCATED
    assert (t.train.world, t.train.dp, t.rollout.gpus, t.rollout.engines) == (16, 8, 16, 8)
    assert t.node_roles() == ["train+rollout", "train+rollout"]


def test_split_derivations():
    t = topo(train_nodes=4, rollout_nodes=1, gpus_per_node=4, tp=2, ep=16, rollout_tp=4)
    assert t.placement is Placement.SPLIT
    assert (t.nodes, t.total_gpus, t.train.world, t.train.dp, t.train.expert_dp) == (5, 20, 16, 8, 1)
    assert t.rollout.engines == 1
    assert t.node_roles() == ["rollout", "train", "train", "train", "train"]


def test_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        topo().train_nodes = 3  # type: ignore[misc]


def test_model_parallel_must_divide_world():
    with pytest.raises(ConfigError, match=r"trainer.tp=3 .* does not divide the 16 training GPUs"):
        TrainParallel(world=16, tp=3)


def test_expert_parallel_must_divide_stage():
    with pytest.raises(ConfigError, match=r"trainer\.ep=32"):
        TrainParallel(world=16, ep=32)


def test_rollout_tp_must_divide_rollout_gpus():
    with pytest.raises(ConfigError, match=r"rollout\.tp=3"):
        RolloutParallel(gpus=8, tp=3)


def test_rollout_tp_larger_than_node():
    with pytest.raises(ConfigError, match=r"rollout.tp=16 is larger than a node \(8 GPUs\)"):
        topo(rollout_tp=16)


def test_training_world_must_be_whole_nodes():
    with pytest.raises(ConfigError, match=r"training world does not match"):
        build_topology(gpus_per_node=8, train=TrainParallel(world=12), rollout_nodes=1, rollout_tp=1)
