"""Issue 38 item 4: rollout nodes of another kind make the job a heterogeneous Slurm job (one component a
node kind), rendered from the plan; the job itself runs in tests/launch/test_slurm.py (USR2 + requeue)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from rich.console import Console

from hpcrl.config.compose import compose_config
from hpcrl.errors import ConfigError
from hpcrl.launch.hetjob import components
from hpcrl.launch.sbatch import render_sbatch, slurm_parameters
from hpcrl.plan.planner import make_plan
from hpcrl.plan.show import show_plan

HET = "+experiment=grpo-tiny-2n1g-fsdp-hetjob"


def _options(block: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?$", block, re.M))


def test_rollout_nodes_of_their_own_kind_are_component_0_of_a_hetjob():
    plan = make_plan(compose_config([HET, "layout.train_nodes=2", "cluster.rollout_node.account=gpu-acct"]))
    text = render_sbatch(plan, Path("/RUN"))
    job, rollout, train = re.split(r"^#SBATCH hetjob$|^# component 0.*$", text, flags=re.M)[:3]
    assert _options(rollout) == {
        "account": "gpu-acct",
        "cpus-per-task": "2",
        "gpus-per-node": "1",
        "nodes": "1",
        "ntasks-per-node": "1",
        "partition": "urgent",
        "time": "20",
    }
    assert _options(train.split("\n\n")[0]) == {
        "cpus-per-task": "2",
        "gpus-per-node": "1",
        "nodes": "2",
        "ntasks-per-node": "1",
        "partition": "debug",
        "time": "30",
    }
    # the job's own options once, before the components; srun starts a task on every node of both
    assert {"job-name", "requeue", "signal", "output", "error"} <= set(_options(job))
    assert not {"nodes", "partition", "time"} & set(_options(job))
    assert re.search(r"^srun .*--het-group=0,1 ", text, re.M)
    assert "export HPCRL_ROLES=rollout,train,train" in text  # node 0, the head, is component 0's


def test_judge_nodes_of_their_own_kind_are_the_last_component():
    """Issue 38 item 4, judges: rollout, training and judge nodes, three components in node order; the
    judge nodes' own keys, srun over all three, the judge node's role last."""
    judge = "+experiment=grpo-tiny-3n1g-fsdp-judge-hetjob"
    plan = make_plan(compose_config([judge, "rewards.judge.nodes=2", "cluster.judge_node.qos=judges"]))
    text = render_sbatch(plan, Path("/RUN"))
    blocks = re.split(r"^#SBATCH hetjob$", text, flags=re.M)
    assert len(blocks) == 3
    assert "# component 2: the judge nodes" in blocks[2]
    assert _options(blocks[2].split("\n\n")[0]) == {
        "cpus-per-task": "2",
        "gpus-per-node": "1",
        "nodes": "2",
        "ntasks-per-node": "1",
        "partition": "urgent",
        "qos": "judges",
        "time": "20",
    }
    assert _options(blocks[1])["partition"] == "debug" and _options(blocks[0])["partition"] == "urgent"
    assert re.search(r"^srun .*--het-group=0,1,2 ", text, re.M)
    assert "export HPCRL_ROLES=rollout,train,judge,judge" in text
    assert plan.job_nodes == 4
    # judges on nodes of the training nodes' kind: one homogeneous job of 2 + 1 nodes
    same = render_sbatch(
        make_plan(
            compose_config([HET.replace("2n1g-fsdp-hetjob", "2n1g-fsdp-split"), "+rewards.judge.nodes=1"])
        ),
        Path("/RUN"),
    )
    assert "hetjob" not in same and "#SBATCH --nodes=3" in same and "HPCRL_ROLES=rollout,train,judge" in same


def test_a_judge_node_kind_without_judge_nodes_is_refused():
    with pytest.raises(
        ConfigError, match=re.escape("cluster.judge_node describes judge nodes, and this run has none")
    ):
        make_plan(compose_config(["+experiment=grpo-tiny-3n1g-fsdp-judge-hetjob", "rewards.judge.nodes=0"]))


def test_one_kind_of_node_is_one_homogeneous_job():
    text = render_sbatch(make_plan(compose_config(["+experiment=grpo-tiny-2n1g-fsdp-split"])), Path("/RUN"))
    assert "hetjob" not in text and "--het-group" not in text


def test_the_engines_share_the_rollout_nodes_memory():
    split = ["+experiment=grpo-tiny-2n1g-fsdp-split", "rollout.gpu_memory_utilization=0.5"]
    same = make_plan(compose_config(split)).memory.rollout
    own = make_plan(compose_config([*split, "+cluster.rollout_node.gpu_memory_gb=64"])).memory.rollout
    assert (same.budget, own.budget) == (8.0, 32.0)  # slurmtest's GPUs: 16 GB


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ([HET, "layout.rollout_nodes=0"], "cluster.rollout_node describes dedicated rollout nodes, but this"),
        (["+cluster.rollout_node.partition=x"], "cluster 'local' is local: remove cluster.rollout_node"),
        ([HET, "cluster.rollout_node.time=soon"], "cluster.rollout_node.time='soon' is not a Slurm time"),
        ([HET, "cluster.rollout_node.gpu_memory_gb=0"], "cluster.rollout_node.gpu_memory_gb"),
    ],
)
def test_rollout_node_mistakes_are_one_line_before_submit(overrides, says):
    with pytest.raises(ConfigError, match=re.escape(says)) as err:
        make_plan(compose_config(overrides))
    assert "\n" not in str(err.value)


ENV_HET = "+experiment=grpo-tiny-3n1g-fsdp-judge-env-hetjob"


def test_environment_nodes_of_their_own_kind_are_a_component_without_gpus():
    """Issue 38 item 4, environments: ``env.nodes`` with ``cluster.env_node`` is the last component,
    with its own keys (memory, CPUs) and no GPUs; the role ``env`` last in the job's roles."""
    overrides = [ENV_HET, "env.nodes=2", "+cluster.env_node.mem_gb=64", "+cluster.env_node.cpus_per_node=32"]
    plan = make_plan(compose_config(overrides))
    assert plan.node_roles() == ["train+rollout", "judge", "env", "env"] and plan.job_nodes == 4
    text = render_sbatch(plan, Path("/RUN"))
    blocks = re.split(r"^#SBATCH hetjob$", text, flags=re.M)
    assert len(blocks) == 3 and "# component 2: the environment nodes" in blocks[2]
    assert _options(blocks[2].split("\n\n")[0]) == {
        "cpus-per-task": "32",
        "mem": "64G",
        "nodes": "2",
        "ntasks-per-node": "1",
        "partition": "urgent",
        "time": "20",
    }
    assert _options(blocks[1])["gpus-per-node"] == "1"  # the judge node keeps its GPU
    assert re.search(r"^srun .*--het-group=0,1,2 ", text, re.M)
    assert "export HPCRL_ROLES=train+rollout,judge,env,env" in text
    console = Console(record=True, width=200)
    show_plan(plan, console, slurm_parameters(plan))  # `hpcrl plan`: the node table's row, the component
    shown = console.export_text()
    assert re.search(
        r"│ 2-3 +│ env +│ 0 +│ calculator environments: an actor each, 32 processes in all", shown
    )
    assert components(plan)[2].line() == (  # `hpcrl plan`'s sbatch table
        "environment nodes (2), partition urgent, time 00:20:00, cpus_per_node 32, mem_gb 64, no GPUs"
    )


def test_environment_nodes_of_the_training_nodes_kind_are_more_nodes_of_one_job():
    plan = make_plan(
        compose_config(["+experiment=grpo-tiny-2n1g-fsdp-split", "+env.name=calculator", "+env.nodes=1"])
    )
    text = render_sbatch(plan, Path("/RUN"))
    assert "hetjob" not in text and "#SBATCH --nodes=3" in text and "HPCRL_ROLES=rollout,train,env" in text


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ([ENV_HET, "env.name="], "env.nodes=1 gives environments nodes of their own, and env.name is empty"),
        ([ENV_HET, "env.nodes=0"], "cluster.env_node describes environment nodes, and this run has none"),
        ([ENV_HET, "env.nodes=-1"], "env.nodes=-1 must be >= 0"),
        ([ENV_HET, "cluster.env_node.mem_gb=0"], "cluster.env_node.mem_gb"),
        (
            ["+env.name=calculator", "+env.nodes=1"],
            "env.nodes=1: a local run has one machine, where the environments run beside the engines",
        ),
    ],
)
def test_environment_node_mistakes_are_one_line_before_submit(overrides, says):
    with pytest.raises(ConfigError, match=re.escape(says)) as err:
        make_plan(compose_config(overrides))
    assert "\n" not in str(err.value)


def test_an_environment_node_gives_ray_no_gpu(monkeypatch):
    """A zero-GPU component's task may inherit node 0's CUDA_VISIBLE_DEVICES: Ray still gets none there."""
    from hpcrl.launch.ray_cluster import this_node

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("SLURM_NODEID", "2")
    assert this_node(["train+rollout", "judge", "env"]).gpus == 0
    monkeypatch.setenv("SLURM_NODEID", "1")
    assert this_node(["train+rollout", "judge", "env"]).gpus == 1
