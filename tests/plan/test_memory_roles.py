"""The plan's memory table on a heterogeneous job (issue 38): where rollout or judge nodes of another kind
hold other GPUs (``cluster.rollout_node``, ``cluster.judge_node``), the table names each role's GPU and
the memory its figures are of, not the training nodes' alone."""

from __future__ import annotations

import re

import pytest

from hpcrl.errors import ConfigError
from tests.conftest import SITE, plan
from tests.plan.test_memory import memory_row, plan_text

HET = ("+experiment=grpo-gemma3-1b-it-2n4g-1n8g-fsdp2-hetjob", *SITE)
"""Two 4-GPU L40S rollout nodes (46 GB) beside an 8-GPU H100 training node (80 GB)."""
JUDGE = (
    "+rewards.judge.model=qwen3_8b",
    "+rewards.judge.nodes=1",
    "+rewards.judge.engines=4",
    "+rewards.judge.parse=yes_no",
)


def test_rollout_nodes_of_another_gpu_name_it_and_its_memory():
    text = plan_text(*HET)
    share = plan(*HET).cfg.rollout.gpu_memory_utilization * 46
    assert "Memory per GPU (GB; train H100 of 80, rollout L40S of 46)" in text
    assert memory_row(text, "rollout: engine share") == f"{share:.1f}"  # of an L40S's 46 GB, not 80
    assert "fits: peak 19 GB of 80 GB per training GPU" in text
    # the same split on one kind of node: one capacity, as before
    same = plan_text(*HET, "cluster.rollout_node=null")
    assert "Memory per GPU (GB of 80)" in same
    assert "fits: peak 19 GB of 80 GB per GPU\n" in same
    assert "rollout H100" not in same
    # rollout nodes known by their memory alone (no cluster.rollout_node.gpu): no model is made up
    unnamed = plan_text(*HET, "cluster.rollout_node.gpu=null", "cluster.rollout_node.gpu_memory_gb=141")
    assert "Memory per GPU (GB; train H100 of 80, rollout of 141)" in unnamed


def test_judge_nodes_of_another_gpu_are_in_the_table():
    own = (
        "+cluster.judge_node.gpu=L40S",
        "+cluster.judge_node.gpu_memory_gb=46",
        "+cluster.judge_node.gpus_per_node=4",
    )
    p = plan(*HET, *JUDGE, *own)
    judge = p.judge
    assert judge is not None
    assert judge.budget_gb == pytest.approx(judge.settings.gpu_memory_utilization * 46)
    text = plan_text(*HET, *JUDGE, *own)
    title = "Memory per GPU (GB; train H100 of 80, rollout L40S of 46, judge L40S of 46)"
    assert title in " ".join(text.split())  # rich wraps a title at its table's width
    assert memory_row(text, "judge: engine share") == f"{judge.budget_gb:.1f}"
    assert memory_row(text, "judge: weights (per GPU)") == f"{judge.weights_gb:.1f}"
    assert memory_row(text, "judge: sequences in KV (fit)") == str(judge.sequences_that_fit)
    # judges on the training nodes' kind of GPU: named as those
    shared = plan_text(*HET, *JUDGE)
    assert "rollout L40S of 46, judge H100 of 80)" in " ".join(shared.split())


@pytest.mark.parametrize(
    ("key", "overrides"),
    [
        ("rollout_node", ["cluster.rollout_node.gpu_memory_gb=null"]),
        ("judge_node", [*JUDGE, "+cluster.judge_node.gpu=L40S"]),
    ],
)
def test_another_gpu_without_its_memory_is_one_line(key, overrides):
    says = f"cluster.{key}.gpu=L40S is another GPU than cluster.gpu=H100: give its memory, cluster.{key}.gpu_memory_gb="
    with pytest.raises(ConfigError, match=re.escape(says)) as err:
        plan(*HET, *overrides)
    assert "\n" not in str(err.value)


def test_the_training_nodes_gpu_model_needs_no_memory_of_its_own():
    p = plan(*HET, *JUDGE, "+cluster.judge_node.gpu=h100")
    assert p.judge is not None
    assert p.judge.budget_gb == pytest.approx(p.judge.settings.gpu_memory_utilization * 80)
