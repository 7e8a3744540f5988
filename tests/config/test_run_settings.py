"""Run settings that used to be constants in the code: the reward pool (``rewards.*``) and the
deadlines of the in-job start-up (``cluster.bootstrap.*``). Each has a default, a check with a one-line
error naming the key, and reaches the code that uses it."""

from __future__ import annotations

import signal

import pytest

from hpcrl.config.cluster import BootstrapConfig
from hpcrl.errors import ConfigError
from hpcrl.launch.job import NodeTask
from hpcrl.launch.ray_cluster import BootstrapError
from hpcrl.plan.planner import make_plan
from hpcrl.rewards import config as rewards_config
from hpcrl.rewards.config import default_processes
from tests.conftest import compose


@pytest.mark.parametrize(
    ("cpus", "processes"), [(1, 2), (2, 2), (16, 2), (32, 4), (96, 12), (192, 16), (1024, 16)]
)
def test_reward_processes_follow_the_nodes_cpus_within_bounds(cpus, processes):
    assert default_processes(cpus) == processes


def test_reward_processes_default_is_derived_when_the_run_starts(monkeypatch):
    monkeypatch.setattr(rewards_config, "available_cpus", lambda: 64)
    assert compose().rewards.processes is None
    assert compose().rewards.process_count() == 8
    assert compose("rewards.processes=3").rewards.process_count() == 3


@pytest.mark.parametrize(
    ("affinity", "slurm", "cpus"), [(64, None, 64), (64, "16", 16), (8, "16", 8), (64, "", 64)]
)
def test_available_cpus_are_the_affinity_within_the_slurm_allocation(monkeypatch, affinity, slurm, cpus):
    """Without task/affinity or cgroups a Slurm task may run on the whole node: the job's share of
    it (SLURM_CPUS_ON_NODE) bounds the reward processes too."""
    monkeypatch.setattr(rewards_config.os, "sched_getaffinity", lambda _pid: set(range(affinity)))
    if slurm is None:
        monkeypatch.delenv("SLURM_CPUS_ON_NODE", raising=False)
    else:
        monkeypatch.setenv("SLURM_CPUS_ON_NODE", slurm)
    assert rewards_config.available_cpus() == cpus


def test_defaults_are_the_values_the_code_had():
    cfg = compose()
    assert (cfg.rewards.timeout_s, cfg.rewards.start_timeout_s) == (5.0, 300.0)
    assert cfg.cluster.bootstrap == BootstrapConfig(shared_dir_s=30.0, ray_head_s=90.0, ray_nodes_s=120.0)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rewards.processes=0", "rewards.processes=0 must be >= 1 (or null: derived from the node's CPUs)"),
        ("rewards.timeout_s=0", "rewards.timeout_s=0.0 must be > 0"),
        ("rewards.start_timeout_s=-1", "rewards.start_timeout_s=-1.0 must be > 0"),
        ("rewards.timeout_s=inf", "rewards.timeout_s=inf must be a finite number of seconds"),
        ("rewards.timeout_s=nan", "rewards.timeout_s=nan must be a finite number of seconds"),
        ("rewards.start_timeout_s=inf", "rewards.start_timeout_s=inf must be a finite number of seconds"),
        ("cluster.bootstrap.shared_dir_s=0", "cluster.bootstrap.shared_dir_s=0.0 must be > 0"),
        ("cluster.bootstrap.ray_head_s=0", "cluster.bootstrap.ray_head_s=0.0 must be > 0"),
        ("cluster.bootstrap.ray_nodes_s=-5", "cluster.bootstrap.ray_nodes_s=-5.0 must be > 0"),
        ("rewards.workers=2", "unknown key 'rewards.workers'"),
        ("rewards.memory_mb=100", "rewards.memory_mb=100 is too little for Python and SymPy: at least 256"),
        ("data.percent=ratio", "data.percent=ratio must be one of number, fraction (or null)"),
        (
            "data.percent=number data.verifier=exact",
            "data.percent rewrites answers for the math and math_structural verifiers; "
            "data.verifier=exact reads its own: drop data.percent",
        ),
    ],
)
def test_bad_values_fail_in_one_line_naming_the_key(override, message):
    with pytest.raises(ConfigError) as info:
        compose(*override.split())
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_node_task_waits_for_the_shared_directory_as_long_as_the_cluster_says(tmp_path, monkeypatch):
    """Node 1 of a job whose node 0 never writes its file: it gives up after
    ``cluster.bootstrap.shared_dir_s``, naming the key; a requeued task keeps the same deadlines."""
    monkeypatch.setenv("SLURM_NODEID", "1")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    bootstrap = compose("cluster=slurmtest", "cluster.bootstrap.shared_dir_s=0.2").cluster.bootstrap
    task = NodeTask(str(tmp_path), ["train", "train"], None, bootstrap=bootstrap)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(BootstrapError, match=r"after 0\.2s \(cluster\.bootstrap\.shared_dir_s\)"):
            task()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert (tmp_path / "nodes" / "1.json").exists()


def test_a_requeued_node_task_keeps_the_deadlines(tmp_path):
    cfg = compose("cluster=slurmtest", "cluster.bootstrap.ray_nodes_s=600")
    task = NodeTask(str(tmp_path), ["train"], make_plan(cfg), bootstrap=cfg.cluster.bootstrap)
    requeued = task.checkpoint().function
    assert requeued.bootstrap.ray_nodes_s == 600 and requeued.plan is task.plan
