"""``hpcrl doctor`` (hpcrl/launch/doctor.py), issue 21 item 6: on this machine (no GPUs), check by
check against real files, sockets and package metadata, and as the first step of a node task."""

from __future__ import annotations

import dataclasses
import os
import socket
from types import SimpleNamespace

import pytest

from hpcrl.launch.doctor import (
    Expect,
    check_disk,
    check_gpus,
    check_imex,
    check_nccl,
    check_paths,
    check_ports,
    check_shared,
    check_versions,
    expect_from_plan,
    interface_matches,
    pins,
    size_text,
)
from hpcrl.launch.job import NodeTask
from hpcrl.launch.ray_cluster import BootstrapError
from tests.conftest import SITE, plan

HOST = socket.gethostname()


def local_expect(**changes: object) -> Expect:
    return dataclasses.replace(expect_from_plan(plan()), **changes)


def test_the_local_cpu_plan_passes_here(cli):
    result = cli("doctor", "--here")
    assert result.returncode == 0, result.stdout + result.stderr
    checks = [line.split()[2] for line in result.stdout.splitlines()]
    assert checks == ["gpus", "nccl", "versions", "paths", "disk", "ports"]
    assert all(line.startswith(f"pass  {HOST}  ") for line in result.stdout.splitlines())
    assert "0 GPUs; the plan runs on CPU" in result.stdout and "match the 'cpu' extra" in result.stdout


def test_a_gb200_plan_fails_here_naming_what_is_missing(cli):
    result = cli("doctor", "--here", "+cluster=gb200", *SITE)
    assert result.returncode == 1
    lines = {line.split()[2]: line for line in result.stdout.splitlines()}
    assert lines["gpus"].startswith(f"FAIL  {HOST}  gpus      0 GPUs, plan wants 4; fix: ")
    assert lines["imex"].startswith("FAIL") and "switch/nvidia_imex" in lines["imex"]
    assert lines["versions"].startswith("FAIL") and "against the 'gpu' extra" in lines["versions"]
    assert lines["nccl"].startswith("pass") and "NCCL_MNNVL_ENABLE=1" in lines["nccl"]


def test_imex_channel_must_exist_and_be_writable(tmp_path):
    expect = local_expect(imex=True)
    assert not check_imex(expect, str(tmp_path)).ok
    channel = tmp_path / "channel0"
    channel.write_text("")
    assert check_imex(expect, str(tmp_path)).ok
    pinned = check_imex(dataclasses.replace(expect, imex_channel=3), str(tmp_path))
    assert not pinned.ok and "channel3" in pinned.detail
    assert check_imex(local_expect(), str(tmp_path)) is None  # not a GB200 plan


def test_nccl_interfaces_follow_nccls_syntax(monkeypatch):
    names = ["lo", "eth0", "ib0"]
    assert interface_matches("eth", names) and interface_matches("^lo,eth", names)
    assert not interface_matches("=eth", names) and interface_matches("=eth0", names)
    assert not interface_matches("^lo,eth,ib", names)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "hsn")
    bad = check_nccl(local_expect(), names)
    assert not bad.ok and "GLOO_SOCKET_IFNAME=hsn matches none of this node's interfaces" in bad.detail
    mnnvl = local_expect(env={"NCCL_MNNVL_ENABLE": "1", "NCCL_CUMEM_ENABLE": "0"})
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    assert "needs NCCL_CUMEM_ENABLE=1" in check_nccl(mnnvl, names).detail


def test_versions_compare_with_the_extras_pins():
    requires = ['torch==2.14.0; extra == "gpu"', 'ray[default]==2.60.0; extra == "gpu"', "numpy>=1"]
    assert pins("gpu", requires) == {"torch": "2.14.0", "ray": "2.60.0"}
    expect = local_expect(extra="gpu", packages=["torch", "ray"])
    wrong = check_versions(expect, {"torch": "2.11.0+cu130", "ray": "2.60.0"}.__getitem__)
    assert not wrong.ok and wrong.detail.startswith("torch 2.11.0+cu130 (pin 2.14.0)")
    right = check_versions(expect, {"torch": "2.14.0+cu130", "ray": "2.60.0"}.__getitem__)
    assert right.ok, right.detail


def test_paths_disk_and_shared_dir(tmp_path):
    missing = tmp_path / "gone.jsonl"
    assert not check_paths(local_expect(paths={"data.source": str(missing)})).ok
    assert check_paths(local_expect(paths={"HF_HOME": str(tmp_path)})).ok
    assert not check_disk(local_expect(disk_dir=str(tmp_path / "a" / "b"), disk_gb=1e9)).ok
    assert check_disk(local_expect(disk_dir=str(tmp_path), disk_gb=0.001)).ok
    assert not check_shared(local_expect(shared_file=str(missing))).ok
    assert check_shared(local_expect()) is None


def test_sizes_read_in_the_unit_that_shows_them():
    # a 64 kB filesystem against a 30 MB checkpoint once read "0 GB free, checkpoints need 0.0 GB"
    sizes = [0, 65536 / 1e9, 0.0305, 1.5, 78.66, 250.4, 1234]
    assert [size_text(gb) for gb in sizes] == [
        "0 B",
        "65.5 kB",
        "30.5 MB",
        "1.5 GB",
        "78.7 GB",
        "250 GB",
        "1.23 TB",
    ]


def test_a_port_held_by_another_process_fails_with_its_number():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = check_ports(local_expect(ports=[[port, port]]))
    assert not result.ok and f"{port} (" in result.detail
    assert check_ports(local_expect(ports=[[port, port]])).ok  # released


def test_ports_held_by_an_ended_jobs_ray_workers_are_waited_for_anything_else_is_not(monkeypatch):
    """A ray::IDLE worker of the node's previous job still listening (it exits on its own once its
    raylet is gone) delays the check until it is gone; a port held by any other process fails at once."""
    import hpcrl.launch.doctor as doctor

    readings = iter([{7001: "ray::IDLE"}, {7001: "ray::IDLE"}, {}])
    monkeypatch.setattr(doctor, "listening_ports", lambda: next(readings))
    monkeypatch.setattr(doctor.time, "sleep", lambda s: None)
    assert check_ports(local_expect(ports=[[7000, 7002]])).ok
    monkeypatch.setattr(doctor, "listening_ports", lambda: {7001: "ray::IDLE", 7002: "nginx"})
    result = check_ports(local_expect(ports=[[7000, 7002]]))
    assert not result.ok and "7001 (ray::IDLE), 7002 (nginx)" in result.detail


def test_checkpoint_space_is_the_plans_checkpoint_times_the_kept_ones(tmp_path):
    p = plan("+experiment=dapo-nemotron-super-5n4g-megatron", *SITE)
    expect = expect_from_plan(p, run_dir=str(tmp_path))
    params = p.cfg.model.param_counts().total
    assert expect.disk_gb == pytest.approx(14 * params / 1e9 * (p.cfg.checkpoint.keep_top_k + 2))
    assert expect.disk_dir == str(tmp_path) and expect.extra == "gpu" and "megatron-core" in expect.packages
    assert Expect.from_json(expect.to_json()) == expect


def test_a_failing_node_ends_its_task_before_ray(tmp_path):
    expect = local_expect(on_gpus=True, node_gpus=[4])  # node 0's own count (a hetjob component's)
    task = NodeTask(str(tmp_path), ["train"], None, bootstrap=plan().cfg.cluster.bootstrap, expect=expect)
    with pytest.raises(
        BootstrapError, match=r"node 0 \(\S+\) failed hpcrl doctor: FAIL .*0 GPUs, plan wants 4"
    ):
        task._doctor(SimpleNamespace(node_id=0, host=HOST, role="train"))
    assert not (tmp_path / "nodes").exists()
    assert os.listdir(tmp_path) == []
    # an environment node (env.nodes) holds no GPU: the same expectation passes the GPU checks there
    env = NodeTask(
        str(tmp_path), ["train", "env"], None, bootstrap=plan().cfg.cluster.bootstrap, expect=expect
    )
    env._doctor(SimpleNamespace(node_id=1, host=HOST, role="env"))


def test_submit_checks_the_checkpoints_room_where_the_filesystem_is_visible(tmp_path):
    """A real 20 MB filesystem; one checkpoint of the tiny model is ~6.1 MB by the plan's estimate."""
    import subprocess

    from hpcrl.errors import ConfigError
    from hpcrl.launch.room import check_room

    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(disk)]).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        warned: list[str] = []

        def room(keep: int, where: str = str(disk / "runs" / "ckpt")) -> None:
            check_room(plan(f"checkpoint.dir={where}", f"checkpoint.keep_top_k={keep}"), None, warned.append)

        with pytest.raises(ConfigError) as refused:  # 4 x 6.1 MB
            room(3)
        line = str(refused.value)
        assert line.startswith("checkpoint.keep_top_k=3 keeps 4 checkpoints, 24.4 MB: ") and "\n" not in line
        assert f"free at {disk};" in line and "6.09 MB" in line and "checkpoint.dir" in line
        room(2)  # 3 fit, not the one being written next to them
        assert len(warned) == 1 and warned[0].startswith("checkpoint.keep_top_k=2: room for 3 checkpoints")
        room(1)
        room(100, "/no-such-mount/ckpt")  # not visible here: the job's doctor checks it on the node
        assert len(warned) == 1
        slurm = plan(f"checkpoint.dir={disk}", "checkpoint.keep_top_k=3", "+cluster=gb200", *SITE)
        check_room(slurm, None, warned.append)  # its nodes may see another filesystem there: a warning
        assert len(warned) == 2 and warned[1].startswith("checkpoint.keep_top_k=3 keeps 4 checkpoints")
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


HET_JOB = (
    "+experiment=grpo-gemma3-1b-it-2n4g-1n8g-fsdp2-hetjob",
    *SITE,
    "+rewards.judge.model=qwen3_8b",
    "+rewards.judge.nodes=1",
    "+rewards.judge.engines=2",
    "+rewards.judge.parse=yes_no",
    "+cluster.judge_node.gpus_per_node=2",
    "+env.name=calculator",
    "+env.nodes=1",
    "+cluster.env_node.cpus_per_node=8",
)
"""Five nodes of four kinds: two 4-GPU rollout nodes, an 8-GPU training node, a 2-GPU judge node and an
environment node without GPUs."""


def test_doctor_job_checks_each_node_as_its_own_role(monkeypatch, capsys):
    """``hpcrl doctor --job`` sends every node the same expectations; each node's task checks them as its
    node of the plan (``SLURM_NODEID``, global over a heterogeneous job's components): its own GPUs, none
    on an environment node. Here (no GPUs) a GPU node fails naming its own count, the env node passes."""
    from hpcrl.tools.doctor_run import doctor_command

    p = plan(*HET_JOB)
    assert p.node_roles() == ["rollout", "rollout", "train", "judge", "env"]
    sent = dataclasses.replace(expect_from_plan(p), ports=[], paths={}, disk_gb=0.0).to_json()
    gpus, codes = [], []
    for node in range(p.job_nodes):
        monkeypatch.setenv("SLURM_NODEID", str(node))
        codes.append(doctor_command([], job=None, here=False, expect_json=sent))
        lines = capsys.readouterr().out.splitlines()
        gpus += [line.split(None, 3)[3] for line in lines if line.split()[2] == "gpus"]
    assert [g.split("; fix: ")[0] for g in gpus] == [
        "0 GPUs, plan wants 4",
        "0 GPUs, plan wants 4",
        "0 GPUs, plan wants 8",
        "0 GPUs, plan wants 2",
        "0 GPUs; the plan runs on CPU",  # the environment node
    ]
    assert codes[:4] == [1, 1, 1, 1]
    # a node with the GPUs of its kind passes, another count fails
    expect = Expect.from_json(sent)
    assert check_gpus(expect.on_node(0), found=4).ok
    assert not check_gpus(expect.on_node(0), found=8).ok
    assert check_gpus(expect.on_node(2), found=8).ok
    assert check_gpus(expect.on_node(3), found=2).ok
    assert expect.on_node(7).gpus_per_node == 8  # a node past the plan's: a training node's count
