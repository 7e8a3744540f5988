"""`hpcrl debug --here`: Ray on an allocation the user already holds, on the real namespace-node Slurm
cluster (salloc, the session, a driver, the user leaving: nothing of it left, the allocation kept), and
its refusals without Slurm."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl.errors import HpcrlError
from hpcrl.launch import here, lifecycle
from tests.conftest import plan, run_cli
from tests.launch.test_debug_sweep import SPLIT, _ray_processes

DETAIL = """JobId=7 JobName=interactive
   JobState=RUNNING Reason=None Dependency=(null)
   NodeList=gpu[01-03]
   JOB_GRES=gpu:10
     Nodes=gpu[01-02] CPU_IDs=0-63 Mem=0 GRES=gpu:h100:4(IDX:0-3)
     Nodes=gpu03 CPU_IDs=0-7,16-23 Mem=0 GRES=gpu:h100:2(IDX:0-1),nic:1
   MinCPUsNode=1
"""


def test_allocation_sizes_are_read_per_node_from_scontrol():
    assert here.per_node(DETAIL) == (2, 16)  # the smallest node: what every node is sure to offer
    assert here.per_node(DETAIL.replace("GRES=gpu:h100:2(IDX:0-1),nic:1", "GRES=")) == (0, 16)


def test_outside_an_allocation_debug_here_is_one_line(monkeypatch, capsys):
    from hpcrl.cli import main

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert main(["debug", "--here", SPLIT]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "this shell is in none (no SLURM_JOB_ID)" in err[0]
    assert "`salloc -N NODES --gpus-per-node=G` or `srun ... --pty bash`" in err[0]


def test_a_plan_bigger_than_the_allocation_is_refused_naming_what_is_short():
    split = plan(SPLIT)  # 2 nodes, 1 GPU each
    here.check_fits(split, here.Allocation("7", ("a", "b", "c"), gpus_per_node=4, cpus_per_node=8))
    with pytest.raises(
        HpcrlError, match=r"allocation 7 holds 1 with 4: 1 node\(s\) short; ask salloc for -N 2"
    ):
        here.check_fits(split, here.Allocation("7", ("a",), gpus_per_node=4, cpus_per_node=8))
    with pytest.raises(HpcrlError, match=r"holds 1 with 0: 1 node\(s\) and 1 GPU\(s\) per node short"):
        here.check_fits(split, here.Allocation("7", ("a",), gpus_per_node=0, cpus_per_node=8))
    two = plan(SPLIT, "+cluster.rollout_node.gpus_per_node=2")  # one step cannot ask 2 here and 1 there
    with pytest.raises(HpcrlError, match=r"this config's nodes have \[2, 1\] GPUs .* submit it"):
        here.check_fits(two, here.Allocation("7", ("a", "b"), gpus_per_node=4, cpus_per_node=8))


def test_cancel_of_a_here_session_names_its_step_not_the_allocation(tmp_path):
    (tmp_path / "job.json").write_text(json.dumps({"job_id": "7", "here": True}))
    assert lifecycle.here_step(tmp_path) == ""  # the head has not checked in
    (tmp_path / "nodes").mkdir()
    (tmp_path / "nodes" / "0.json").write_text(json.dumps({"step": "3"}))
    assert lifecycle.here_step(tmp_path) == "7.3"
    (tmp_path / "job.json").write_text(json.dumps({"job_id": "7", "debug": True}))
    assert lifecycle.here_step(tmp_path) is None  # a job of its own: scancel the job


def test_an_allocation_with_hpcrls_ray_already_up_is_refused(tmp_path):
    here.check_free("7", tmp_path)  # nothing of hpcrl's in allocation 7
    run_dir = tmp_path / "job-run"
    run_dir.mkdir()
    (run_dir / "job.json").write_text(json.dumps({"job_id": "7", "debug": True}))
    (tmp_path / ".jobs").mkdir()
    (tmp_path / ".jobs" / "7").write_text(str(run_dir))
    with pytest.raises(HpcrlError, match=f"allocation 7 already runs hpcrl's Ray \\(run dir {run_dir}\\)"):
        here.check_free("7", tmp_path)  # an hpcrl job's own allocation (an attach shell)


def _started_by(session: Path, job_id: str) -> list[str]:
    """Processes of this machine (all node namespaces share its /proc) that name the session's run
    directory or its Ray temp dirs: the holder, srun, the node tasks, raylets, GCS."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(session) in cmd or f"hpcrl-ray-{job_id}-" in cmd:
            found.append(f"{pid}: {cmd[:100]}")
    return found


def _wait_for(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} not written after {timeout_s}s"
        time.sleep(0.5)


@pytest.mark.slow
def test_debug_here_in_a_held_allocation_runs_a_driver_and_leaving_stops_only_its_ray(
    slurm_cluster, tmp_path
):
    held = subprocess.run(
        ["salloc", "--no-shell", "-N2", "--gpus-per-node=1", "-t", "15", "-J", "user-alloc"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    job_id = re.search(r"Granted job allocation (\d+)", held.stderr).group(1)
    # the shell salloc would give the user (on the login host): the allocation's environment
    env = {**os.environ, "SLURM_JOB_ID": job_id, "SLURM_JOB_NODELIST": "hpcrl-node[1-2]", "SLURM_NNODES": "2"}
    hpcrl = Path(sys.executable).with_name("hpcrl")
    root = ["--root", str(tmp_path)]
    try:
        short = subprocess.run(
            [hpcrl, "debug", "--here", SPLIT, "layout.train_nodes=2", f"run.output_root={tmp_path}"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert (
            short.returncode == 2 and f"allocation {job_id} holds 2 with 1: 1 node(s) short" in short.stderr
        )
        assert not (tmp_path / ".jobs").exists()  # refused before anything was written or started

        out = tmp_path / "debug.out"
        shell = subprocess.Popen(  # stays until its stdin closes: the user leaving
            [
                "bash",
                "-c",
                f"{hpcrl} debug --here {SPLIT} run.output_root={tmp_path} >{out} 2>&1; "
                f"echo $? >{out}.rc; read -r _ || true",
            ],
            stdin=subprocess.PIPE,
            env=env,
        )
        _wait_for(Path(f"{out}.rc"), 300)
        started = out.read_text()
        assert Path(f"{out}.rc").read_text().strip() == "0", started
        assert re.search(r"^ready\s+Ray up on hpcrl-node1, hpcrl-node2", started, re.M), started
        session = lifecycle.run_dir_of(job_id, tmp_path)
        step = lifecycle.here_step(session)
        assert step and lifecycle.step_running(step) and _started_by(session, job_id)

        again = subprocess.run(
            [hpcrl, "debug", "--here", SPLIT, f"run.output_root={tmp_path}"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert again.returncode == 2 and f"allocation {job_id} already runs hpcrl's Ray" in again.stderr
        where = run_cli("attach", job_id, "1", *root, "--", "hostname")
        assert where.returncode == 0 and where.stdout.strip() == "hpcrl-node2", where.stderr
        run = subprocess.run(  # the job defaults to the allocation's: $SLURM_JOB_ID
            [hpcrl, "run", *root, SPLIT, "algo.max_steps=1", "algo.num_prompts_per_step=16", "run.name=here"],
            capture_output=True,
            text=True,
            env=env,
            timeout=400,
        )
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        run_dir = Path(re.search(r"^run dir (\S+)", run.stdout, re.M).group(1))
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert rows[-1]["step"] == 1 and run_dir.parent.parent == lifecycle.run_dir_of(job_id, tmp_path)
        assert "placed: train x1 on hpcrl-node2; rollout x1 on hpcrl-node1" in run.stdout

        shell.stdin.close()  # the user leaves the shell
        assert shell.wait(timeout=10) == 0
        deadline = time.monotonic() + 60
        while (_ray_processes(2) or _started_by(session, job_id)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _ray_processes(2) == [] and _started_by(session, job_id) == []
        assert not lifecycle.step_running(step)
        assert lifecycle.job_state(job_id) == "RUNNING"  # the allocation is the user's: it stays
        refused = subprocess.run([hpcrl, "run", *root, SPLIT], capture_output=True, text=True, env=env)
        assert refused.returncode == 2 and "has stopped its Ray" in refused.stderr
    finally:
        subprocess.run(["scancel", job_id], check=False)
