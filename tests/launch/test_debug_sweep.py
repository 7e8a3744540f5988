"""Issue 6 on the real namespace-node Slurm cluster: a held debug session with two `hpcrl run`
drivers one after the other, `hpcrl attach`, a refused config, cancel (and nothing left running);
a 3-point `hpcrl submit -m` sweep whose points all finish, with `hpcrl ls --sweep` right."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from hpcrl.launch import lifecycle
from hpcrl.tools.sweep import expand
from tests.conftest import run_cli

SPLIT = "+experiment=grpo-tiny-2n1g-fsdp-split"
SHORT = ["algo.max_steps=2", "algo.num_prompts_per_step=16", "algo.val_period=2"]


def test_expand_is_the_cartesian_product_of_sweep_axes():
    points = expand(["algo.lr=1e-6,3e-6", "+experiment=x", "algo.kl_coef=0,0.01", "run.name=s"])
    assert points == [
        ["algo.lr=1e-06", "+experiment=x", "algo.kl_coef=0", "run.name=s"],
        ["algo.lr=1e-06", "+experiment=x", "algo.kl_coef=0.01", "run.name=s"],
        ["algo.lr=3e-06", "+experiment=x", "algo.kl_coef=0", "run.name=s"],
        ["algo.lr=3e-06", "+experiment=x", "algo.kl_coef=0.01", "run.name=s"],
    ]


def test_one_bad_sweep_point_submits_nothing(tmp_path):
    result = run_cli(
        "submit",
        "-m",
        "+experiment=grpo-tiny-1n1g-fsdp",
        "cluster=slurmtest",
        "trainer.tp=1,3",
        f"run.output_root={tmp_path}",
    )
    assert result.returncode == 2
    assert "sweep point 1 (trainer.tp=3)" in result.stderr and "nothing was submitted" in result.stderr
    assert not (tmp_path / "sweeps").exists() and not (tmp_path / ".jobs").exists()


def _ray_processes(nodes: int) -> list[str]:
    found = []
    for i in range(1, nodes + 1):
        pids = subprocess.run(
            ["ip", "netns", "pids", f"hpcrl-node{i}"], capture_output=True, text=True
        ).stdout
        for pid in pids.split():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "ray" in cmd and "slurmd" not in cmd:
                found.append(f"hpcrl-node{i}: {cmd[:80]}")
    return found


@pytest.mark.slow
def test_debug_session_runs_two_drivers_then_cancel_leaves_nothing(slurm_cluster, tmp_path):
    root = ["--root", str(tmp_path)]
    started = run_cli("debug", SPLIT, f"run.output_root={tmp_path}", timeout=300)
    assert started.returncode == 0, started.stderr
    job_id = re.search(r"^job\s+(\d+)", started.stdout, re.M).group(1)
    assert re.search(r"^ready\s+Ray up on hpcrl-node1, hpcrl-node2", started.stdout, re.M), started.stdout
    assert f"hpcrl run --job {job_id}" in started.stdout

    where = run_cli("attach", job_id, "1", *root, "--", "hostname")
    assert where.returncode == 0 and where.stdout.strip() == "hpcrl-node2", where.stderr

    ray_dir = lifecycle.run_dir_of(job_id, tmp_path) / "ray"
    head = (ray_dir / f"head-{job_id}.json").read_text()
    for attempt in range(2):  # the same Ray cluster serves both drivers
        run = run_cli("run", "--job", job_id, *root, SPLIT, *SHORT, f"run.name=drive{attempt}", timeout=400)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        run_dir = Path(re.search(r"^run dir (\S+)", run.stdout, re.M).group(1))
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert rows[-1]["step"] == 2 and run_dir.parent.parent == lifecycle.run_dir_of(job_id, tmp_path)
        assert "placed: train x1 on hpcrl-node2; rollout x1 on hpcrl-node1" in run.stdout
    assert lifecycle.job_state(job_id) == "RUNNING"
    assert (ray_dir / f"head-{job_id}.json").read_text() == head  # one bootstrap, never restarted

    refused = run_cli("run", "--job", job_id, *root, SPLIT, "layout.train_nodes=2")
    assert refused.returncode == 2
    assert (
        f"needs 3 node(s) with roles ['rollout', 'train', 'train'], but debug job {job_id} holds 2"
        in refused.stderr
    )

    cancelled = run_cli("cancel", job_id, *root)
    assert cancelled.returncode == 0
    deadline = time.monotonic() + 30
    while _ray_processes(2) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _ray_processes(2) == []  # the reaper stopped every Ray process of the job
    assert lifecycle.wait(job_id, None, timeout_s=30) == "CANCELLED"


@pytest.mark.slow
def test_three_point_sweep_all_finish_and_ls_sweep_shows_them(slurm_cluster, tmp_path):
    result = run_cli(
        "submit",
        "-m",
        "+experiment=grpo-tiny-1n1g-fsdp",
        "cluster=slurmtest",
        *SHORT,
        "algo.lr=1e-4,3e-4,1e-3",
        f"run.output_root={tmp_path}",
        "run.name=sw",
    )
    assert result.returncode == 0, result.stderr
    sweep_dir = Path(re.search(r"^sweep\s+(\S+)", result.stdout, re.M).group(1))
    points = json.loads((sweep_dir / "sweep.json").read_text())["points"]
    assert [p["overrides"] for p in points] == [["algo.lr=0.0001"], ["algo.lr=0.0003"], ["algo.lr=0.001"]]
    assert len({p["job_id"] for p in points}) == 3 and len({p["run_dir"] for p in points}) == 3
    for p in points:
        state = lifecycle.wait(p["job_id"], Path(p["run_dir"]), timeout_s=600)
        assert state == "COMPLETED", (p, run_cli("logs", p["job_id"], "--root", str(tmp_path)).stdout[-3000:])
    listing = run_cli("ls", "--sweep", str(sweep_dir))
    assert listing.returncode == 0
    lines = [line for line in listing.stdout.splitlines()[1:] if line.strip()]
    assert len(lines) == 3
    for p, line in zip(points, lines, strict=True):
        assert p["job_id"] in line and "COMPLETED" in line and " ".join(p["overrides"]) in line
        assert "val/accuracy=" in line and "@ step 2" in line


def test_attach_command_uses_the_jobs_container_and_overlaps_the_allocation():
    from hpcrl.launch.debug import attach_argv

    meta = {"container_args": ["--container-image=img.sqsh", "--container-mounts=/data:/data"]}
    shell = attach_argv("42", meta, "node7", [])
    assert shell[:6] == ["srun", "--jobid=42", "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=node7"]
    assert shell[6:8] == meta["container_args"] and "--pty" in shell
    assert attach_argv("42", meta, "node7", ["nvidia-smi"])[-1] == "nvidia-smi"


def test_a_config_that_does_not_fit_the_held_allocation_is_refused():
    from hpcrl.errors import HpcrlError
    from hpcrl.launch.debug import check_fits_allocation
    from tests.conftest import plan

    held = {"roles": ["rollout", "train"], "nodes": 2, "gpus_per_node": 1}
    check_fits_allocation(plan(SPLIT), "9", held)  # the same layout: accepted
    with pytest.raises(
        HpcrlError, match=r"needs 1 node\(s\) with roles \['train\+rollout'\], but debug job 9 holds 2"
    ):
        check_fits_allocation(plan("+experiment=grpo-tiny-1n1g-fsdp", "cluster=slurmtest"), "9", held)
    with pytest.raises(HpcrlError, match="uses 1 GPUs per node; debug job 9 holds 4"):
        check_fits_allocation(plan(SPLIT), "9", {**held, "gpus_per_node": 4})
    # a debug job whose rollout node holds 2 GPUs (cluster.rollout_node.gpus_per_node), this config 1
    with pytest.raises(
        HpcrlError, match=r"this config's nodes have \[1, 1\] GPUs; debug job 9's have \[2, 1\]"
    ):
        check_fits_allocation(plan(SPLIT), "9", {**held, "node_gpus": [2, 1]})
