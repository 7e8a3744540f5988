"""The optimizer settings in the memory estimate (``trainer.optimizer*``), against hand-computed
numbers, and their refusals."""

from __future__ import annotations

import pytest

from hpcrl.errors import ConfigError
from hpcrl.plan.planner import DoesNotFitError
from tests.conftest import SITE, compose, plan
from tests.plan.test_memory import memory_row, plan_text

GB = 1e9
LLAMA = ("model=llama3p1_8b", "trainer=fsdp", "cluster=h100", *SITE)
PARAMS = 8_029_995_008
SHARD = PARAMS / 8  # one node of 8 H100s, FSDP over all of them
EMBEDDING_SHARD = 128256 * 4096 / 8  # the largest tensor's shard: the one stepped at a time


@pytest.mark.parametrize(
    ("overrides", "gpu", "host"),
    [
        ([], 8 * SHARD, 0.0),  # fp32 m + v
        # kept in bf16, the one tensor stepped: fp32 m + v and the rounding's 8 bytes
        (["trainer.optimizer_dtype=bfloat16"], 4 * SHARD + 16 * EMBEDDING_SHARD, 0.0),
        (["trainer.optimizer_offload=true"], 8 * EMBEDDING_SHARD, 8 * SHARD),
        (
            ["trainer.optimizer_offload=true", "trainer.optimizer_dtype=bfloat16"],
            16 * EMBEDDING_SHARD,
            4 * SHARD,
        ),
        # row + column means of each matrix (2 / hidden values a parameter), and the step's workspace
        (["trainer.optimizer=adafactor"], 4 * 2 / 4096 * SHARD + 12 * EMBEDDING_SHARD, 0.0),
    ],
    ids=["adamw", "bf16", "offload", "offload-bf16", "adafactor"],
)
def test_optimizer_state_per_gpu_and_host_hand_computed(overrides, gpu, host):
    p = plan(*LLAMA, *overrides)
    assert p.topology.train.world == 8
    m = p.memory
    assert m.train.optimizer == pytest.approx(gpu / GB)
    assert m.train.host == pytest.approx(host / GB)
    assert m.host_per_node == pytest.approx(8 * host / GB)
    assert m.train.weights == pytest.approx(plan(*LLAMA).memory.train.weights)  # the weights stay


def test_checkpoint_size_counts_the_optimizer_state():
    from hpcrl.launch.doctor import checkpoint_gb

    full, bf16 = (checkpoint_gb(plan(*LLAMA, *o)) for o in ([], ["trainer.optimizer_dtype=bfloat16"]))
    assert full == pytest.approx(12 * PARAMS / GB) and bf16 == pytest.approx(8 * PARAMS / GB)


def test_plan_shows_the_host_memory_and_refuses_what_does_not_fit():
    text = plan_text(*LLAMA, "trainer.optimizer_offload=true", "cluster.host_memory_gb=2000")
    assert (
        memory_row(text, "host: offloaded optimizer state per node (GB of 2000)") == f"{64 * SHARD / GB:.1f}"
    )
    assert "host:" not in plan_text(*LLAMA)
    small = plan(*LLAMA, "trainer.optimizer_offload=true", "cluster.host_memory_gb=40")
    assert small.memory.problems == [
        "the offloaded optimizer state needs 64 GB of host memory per node of 40 GB (cluster.host_memory_gb)"
    ]
    with pytest.raises(DoesNotFitError, match="host memory per node of 40 GB"):
        small.require_fit()


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (
            ["trainer=megatron", "trainer.optimizer_offload=true"],
            "trainer.optimizer_offload=true is not supported by trainer=megatron: use trainer=fsdp, "
            "or drop trainer.optimizer_offload",
        ),
        (
            ["trainer=megatron", "trainer.optimizer=adafactor"],
            "trainer.optimizer=adafactor is not supported by trainer=megatron: use trainer=fsdp, "
            "or drop trainer.optimizer",
        ),
        (
            ["trainer.optimizer=adafactor", "trainer.betas=[0.9,0.99]"],
            "trainer.betas=[0.9, 0.99] is AdamW's; trainer.optimizer=adafactor has no betas: drop trainer.betas",
        ),
        (["cluster.host_memory_gb=0"], "cluster.host_memory_gb"),
    ],
)
def test_optimizer_refusals_name_the_key(overrides, says):
    with pytest.raises(ConfigError) as err:
        compose(*overrides)
    assert says in str(err.value) and "\n" not in str(err.value)
