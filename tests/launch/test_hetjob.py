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
from tests.conftest import SITE

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
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")  # node 0's, leaked into a 4-GPU node's task
    monkeypatch.setenv("SLURM_NODEID", "1")
    assert this_node(["rollout", "rollout", "train"], [4, 4, 8]).gpus == 4  # the plan's count caps it
    monkeypatch.setenv("SLURM_NODEID", "2")
    assert this_node(["rollout", "rollout", "train"], [4, 4, 8]).gpus == 8


GPUS_HET = "+experiment=grpo-gemma3-1b-it-2n4g-1n8g-fsdp2-hetjob"


def test_rollout_nodes_with_their_own_gpu_count():
    """Issue 38 item 4, a component's own GPUs: two 4-GPU L40S rollout nodes beside an 8-GPU H100 training
    node. The plan's engines, GPUs and engine memory are the rollout nodes' own; each component asks for
    its own --gpus-per-node; `hpcrl plan` shows each node's; each node's doctor and Ray count its own."""
    from hpcrl.launch.doctor import expect_from_plan
    from hpcrl.launch.ray_cluster import cluster_gpus
    from hpcrl.plan.components import node_gpus

    plan = make_plan(compose_config([GPUS_HET, *SITE]))
    topo = plan.topology
    assert (topo.rollout_gpus_per_node, topo.gpus_per_node, topo.train.world) == (4, 8, 8)
    assert (topo.rollout.engines, topo.total_gpus, plan.job_nodes) == (8, 16, 3)
    assert plan.memory.rollout.budget == pytest.approx(plan.cfg.rollout.gpu_memory_utilization * 46)
    assert node_gpus(plan) == [4, 4, 8] and plan.node_roles() == ["rollout", "rollout", "train"]
    assert make_plan(compose_config([GPUS_HET, *SITE, "rollout.tp=4"])).topology.rollout.engines == 2
    rollout, train = re.split(r"^#SBATCH hetjob$", render_sbatch(plan, Path("/RUN")), flags=re.M)
    assert _options(rollout.split("# component 0")[1])["gpus-per-node"] == "4"
    assert _options(rollout.split("# component 0")[1])["partition"] == "l40s"
    assert _options(train.split("\n\n")[0])["gpus-per-node"] == "8"
    console = Console(record=True, width=200)
    show_plan(plan, console, slurm_parameters(plan))
    shown = console.export_text()
    assert "Nodes: 3 of 4 / 8 GPUs, split" in shown
    assert re.search(r"│ 1 +│ rollout +│ 4 +│ 4 vllm engine\(s\) x TP1 ", shown)
    assert re.search(r"│ 2 +│ train +│ 8 +│ trainer ranks 0-7 ", shown)
    assert [c.line().rsplit(", ", 1)[1] for c in components(plan)] == ["4 GPUs each", "8 GPUs each"]
    expect = expect_from_plan(plan)
    assert expect.node_gpus == [4, 4, 8]
    assert [expect.for_node(i, r).gpus_per_node for i, r in enumerate(plan.node_roles())] == [4, 4, 8]
    assert cluster_gpus(plan.node_roles(), expect.node_gpus, head_gpus=4) == 16  # what the head waits for
    assert cluster_gpus(plan.node_roles(), expect.node_gpus, head_gpus=0) == 0  # a CPU cluster


def test_auto_layout_sizes_the_rollout_side_on_the_rollout_nodes_gpus():
    from hpcrl.plan.planner import plan_config

    plan = make_plan(compose_config([GPUS_HET, *SITE]))
    auto = plan_config(compose_config([GPUS_HET, *SITE, "layout.auto=true"]))
    assert plan.fits and auto.search is not None
    chosen = auto.search.chosen
    assert auto.topology.rollout_nodes >= 1  # never colocated: dedicated rollout nodes are split only
    assert chosen.gpus == auto.topology.total_gpus == 4 * auto.topology.rollout_nodes + 8
    assert (
        chosen.engines
        == auto.topology.rollout.engines
        == 4 * auto.topology.rollout_nodes // chosen.layout.rollout_tp
    )


def test_judge_nodes_with_their_own_gpu_count():
    judge = "+experiment=grpo-tiny-3n1g-fsdp-judge-hetjob"
    plan = make_plan(compose_config([judge, "+cluster.judge_node.gpus_per_node=2"]))
    text = render_sbatch(plan, Path("/RUN"))
    blocks = re.split(r"^#SBATCH hetjob$", text, flags=re.M)
    own = [_options(b.split("# component")[1].split("\n\n")[0]) for b in blocks]
    assert [o["gpus-per-node"] for o in own] == ["1", "1", "2"]
    gpus = make_plan(compose_config([judge, *JUDGE_ON_GPUS, "+cluster.judge_node.gpus_per_node=2"])).judge
    assert gpus is not None and gpus.gpus == 2  # two TP1 engines on one 2-GPU judge node


JUDGE_ON_GPUS = ["cluster.gpu=H100", "rewards.judge.engines=2"]


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (
            [GPUS_HET, *SITE, "rollout.tp=8"],
            "rollout.tp=8 is larger than a rollout node (4 GPUs, cluster.rollout_node.gpus_per_node)",
        ),
        (
            [GPUS_HET, *SITE, "cluster.rollout_node.gpus_per_node=6", "rollout.tp=4"],
            "rollout.tp=4 must divide the 6 GPUs of a rollout node, cluster.rollout_node.gpus_per_node",
        ),
        (
            [GPUS_HET, *SITE, "layout.rollout_nodes=0"],
            "cluster.rollout_node.gpus_per_node describes dedicated rollout nodes, but this layout is colocated",
        ),
        (
            [GPUS_HET, *SITE, "cluster.rollout_node.gpus_per_node=0"],
            "cluster.rollout_node.gpus_per_node=0 must be > 0",
        ),
        (
            [
                "+experiment=grpo-tiny-3n1g-fsdp-judge-hetjob",
                *JUDGE_ON_GPUS,
                "rewards.judge.tp=2",
                "+cluster.judge_node.gpus_per_node=3",
            ],
            "rewards.judge.tp=2 must divide a judge node's 3 GPUs (cluster.judge_node.gpus_per_node",
        ),
    ],
)
def test_own_gpu_count_mistakes_are_one_line_before_submit(overrides, says):
    with pytest.raises(ConfigError, match=re.escape(says)) as err:
        make_plan(compose_config(overrides))
    assert "\n" not in str(err.value)
