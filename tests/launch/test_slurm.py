"""`hpcrl submit` / status / logs / ls on the real namespace-node Slurm cluster (tools/slurm-cluster)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import pytest

from hpcrl.launch import lifecycle
from hpcrl.launch.doctor import IMEX_DIR, pins
from tests.conftest import run_cli

pytestmark = pytest.mark.slow


def test_submit_places_one_task_per_node_with_roles(slurm_cluster, tmp_path):
    result = run_cli(
        "submit",
        "--smoke",
        "cluster=slurmtest",
        "model=tiny",
        "data.max_prompt_tokens=56",  # with 8 new tokens, within the tiny model's 64 positions:
        "rollout.max_new_tokens=8",  # submit refuses more
        "layout.train_nodes=2",
        "layout.rollout_nodes=1",
        f"run.output_root={tmp_path}",
        "run.name=checkin",
    )
    assert result.returncode == 0, result.stderr
    job_id = re.search(r"^job\s+(\d+)", result.stdout, re.M).group(1)
    run_dir = lifecycle.run_dir_of(job_id, tmp_path)
    assert (run_dir / "sbatch.sh").read_text().count("#SBATCH --nodes=3") == 1
    state = lifecycle.wait(job_id, run_dir, timeout_s=240)
    assert state == "COMPLETED", state
    assert lifecycle.sacct_state(job_id) == "COMPLETED"  # slurmdbd + MariaDB keep the record for good
    records = [json.loads((run_dir / "nodes" / f"{i}.json").read_text()) for i in range(3)]
    assert [r["role"] for r in records] == ["rollout", "train", "train"]
    assert [r["host"] for r in records] == ["hpcrl-node1", "hpcrl-node2", "hpcrl-node3"]
    assert all(
        r["gpus"] == "0" and r["job_id"] == job_id for r in records
    )  # --gpus-per-node reached the tasks

    status = run_cli("status", job_id, "--root", str(tmp_path))
    assert f"{job_id}  COMPLETED  checkin  3 node(s)" in status.stdout
    logs = run_cli("logs", job_id, "--root", str(tmp_path))
    for i, role in enumerate(["rollout", "train", "train"]):
        assert f"{job_id}_{i}_log.out" in logs.stdout
        assert f"node {i} (hpcrl-node{i + 1}) checked in as {role}" in logs.stdout
    listing = run_cli("ls", "--root", str(tmp_path))
    assert job_id in listing.stdout and "checkin" in listing.stdout

    # Ray came up across the three nodes and placed one actor per node by its role resource
    placement = json.loads((run_dir / "placement.json").read_text())["actors"]
    assert [(a["role"], a["host"], a["gpus"]) for a in placement] == [
        ("rollout", "hpcrl-node1", ["0"]),
        ("train", "hpcrl-node2", ["0"]),
        ("train", "hpcrl-node3", ["0"]),
    ]
    # every port Ray listens on, on every node, is a pinned one below 9000 (site firewalls)
    for actor in placement:
        ports = {
            int(port): name
            for port, name in actor["listening"].items()
            if name not in ("slurmd", "slurmstepd", "srun")
        }  # Slurm's own ports are the site's
        assert ports and max(ports) < 9000, f"{actor['host']}: {ports}"
        assert sum(name.startswith("ray::DashboardA") for name in ports.values()) == 3  # pinned agent ports
    assert "1200" in placement[0]["listening"]  # the GCS, on the head (the rollout node)
    ready = json.loads((run_dir / "ray" / f"ready-{job_id}.json").read_text())
    assert 0 < ready["seconds"] < 120
    token = run_dir / "ray" / "token"
    assert token.stat().st_mode & 0o777 == 0o600
    assert token.read_text() not in (run_dir / "sbatch.sh").read_text()  # the secret never reaches the script


def test_unknown_job_is_one_clear_line(tmp_path):
    result = run_cli("status", "999999", "--root", str(tmp_path))
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        == f"hpcrl: error: no run of job 999999 under {tmp_path}/; pass --root <run.output_root> if it is elsewhere"
    )


def _namespace_pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=True).stdout
    return [int(p) for p in out.split()]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_client_without_token_is_refused_and_a_dead_node_ends_the_job(slurm_cluster, tmp_path):
    result = run_cli(
        "submit",
        "--smoke",
        "cluster=slurmtest",
        "model=tiny",
        "data.max_prompt_tokens=56",  # with 8 new tokens, within the tiny model's 64 positions:
        "rollout.max_new_tokens=8",  # submit refuses more
        "layout.train_nodes=2",
        "layout.rollout_nodes=1",
        f"run.output_root={tmp_path}",
        "run.name=failfast",
        "--hold",
        "300",
    )
    assert result.returncode == 0, result.stderr
    job_id = re.search(r"^job\s+(\d+)", result.stdout, re.M).group(1)
    run_dir = lifecycle.run_dir_of(job_id, tmp_path)
    ready = run_dir / "placement.json"
    deadline = time.monotonic() + 180
    while not ready.exists():
        assert time.monotonic() < deadline, "Ray never became ready"
        time.sleep(0.5)

    # a client without the job's token is refused by the head
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    head = json.loads((run_dir / "ray" / f"head-{job_id}.json").read_text())
    probe = subprocess.run(
        [sys.executable, "-c", f"import ray; ray.init(address='{head['ip']}:{head['port']}')"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert probe.returncode != 0
    assert "InvalidAuthToken" in probe.stderr or "uthentication" in probe.stderr, probe.stderr[-2000:]

    # kill every Ray process of the third node: the job must end, non-zero, naming that node
    killed_at = time.monotonic()
    for pid in _namespace_pids("hpcrl-node3"):
        if "raylet" in _cmdline(pid) or "hpcrl.launch.ray_node" in _cmdline(pid):
            os.kill(pid, signal.SIGKILL)
    state = lifecycle.wait(job_id, run_dir, timeout_s=90)
    assert time.monotonic() - killed_at < 60, state
    assert state in ("FAILED", "CANCELLED", "NODE_FAIL"), state
    logs = run_cli("logs", job_id, "--root", str(tmp_path)).stdout
    assert "Ray on node 2 (hpcrl-node3) exited with code" in logs, logs[-3000:]


def fetch_tiny_from_a_standin_hub(overrides: list[str], hf_home: Path) -> None:
    """The warm-started tiny model, published on a STAND-IN hub (tests/harness/hub_standin.py) as org/tiny-math,
    fetched by `hpcrl fetch` into ``hf_home``; the stand-in is gone before anything is submitted."""
    from hpcrl.config.compose import cache_dir
    from hpcrl.run.tiny_model import ensure_tiny_model
    from tests.conftest import compose
    from tests.harness.hub_standin import HubStandIn, Repo

    cfg = compose(*overrides)
    built = ensure_tiny_model(cfg.model, cache_dir(), seed=cfg.run.seed, log=lambda _: None)
    with HubStandIn({"org/tiny-math": Repo({p.name: p.read_bytes() for p in built.iterdir()})}) as hub:
        env = {
            **os.environ,
            "HF_ENDPOINT": hub.url,
            "HF_HOME": str(hf_home),
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        }
        env.pop("HF_HUB_OFFLINE", None)
        cmd = [sys.executable, "-m", "hpcrl.cli", "fetch", *overrides, "model.hf_id=org/tiny-math"]
        fetched = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert fetched.returncode == 0, fetched.stderr
    assert re.search(r"^model org/tiny-math: fetched \d+ of \d+ files", fetched.stdout, re.M), fetched.stdout


def test_split_tiny_run_learns_with_its_trainer_context_parallel_over_two_nodes(slurm_cluster, tmp_path):
    """Issue 4 item 9: the tiny recipe split, through `hpcrl submit`: 1 rollout node, and here 2 train
    nodes whose fsdp ranks split every sequence (trainer.cp=2, gloo between the nodes). The engine gets
    exactly the trained weights (gen_kl_error ~0) and the run learns. Issue 32: the model comes by hub id,
    fetched beforehand into a Hugging Face cache on the shared filesystem; the job resolves it offline."""
    overrides = ["+experiment=grpo-tiny-2n1g-fsdp-split", "layout.train_nodes=2", "trainer.cp=2"]
    hf_home = tmp_path / "hf"
    fetch_tiny_from_a_standin_hub(overrides, hf_home)
    result = run_cli(
        "submit",
        *overrides,
        "model.hf_id=org/tiny-math",
        f"+cluster.env.HF_HOME={hf_home}",
        f"run.output_root={tmp_path}",
    )
    assert result.returncode == 0, result.stderr
    job_id = re.search(r"^job\s+(\d+)", result.stdout, re.M).group(1)
    run_dir = lifecycle.run_dir_of(job_id, tmp_path)
    state = lifecycle.wait(job_id, run_dir, timeout_s=540)
    logs = run_cli("logs", job_id, "--root", str(tmp_path)).stdout
    assert state == "COMPLETED", (state, logs[-3000:])
    placement = json.loads((run_dir / "placement.json").read_text())["actors"]
    assert sorted((a["role"], a["host"]) for a in placement) == [
        ("rollout", "hpcrl-node1"),
        ("train", "hpcrl-node2"),
        ("train", "hpcrl-node3"),
    ]
    assert "  cp: 2\n" in (run_dir / "config.yaml").read_text()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 30
    assert all(abs(r["train/gen_kl_error"]) < 1e-4 for r in rows if "train/gen_kl_error" in r)
    # Single steps are noisy (one run here: 0.23-0.40 over the last ten): the last ten steps against
    # the first five, and the fixed validation set before and after.
    rewards = [r["train/reward"] for r in rows if "train/reward" in r]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-10:]) / 10
    assert len(rewards) == 30 and last > first + 0.05, (first, last, rewards)
    vals = [r["val/accuracy"] for r in rows if "val/accuracy" in r]
    assert vals[-1] > vals[0] + 0.05, vals
    assert "validation accuracy" in logs
    assert "placed: train x2 on hpcrl-node2, hpcrl-node3; rollout x1 on hpcrl-node1" in logs
    snapshot = next((hf_home / "hub" / "models--org--tiny-math" / "snapshots").iterdir())
    assert f"model org/tiny-math (revision {snapshot.name}): {snapshot}" in logs  # pinned at submit
    assert "export HF_HUB_OFFLINE=1" in (run_dir / "sbatch.sh").read_text()


def test_state_falls_back_to_scontrol_without_accounting(monkeypatch):
    """On a cluster without slurmdbd (sacct prints nothing useful) the state comes from scontrol."""
    answers = {"squeue": "", "sacct": "", "scontrol": "JobId=7 JobName=x\n   JobState=TIMEOUT Reason=None"}
    monkeypatch.setattr(lifecycle, "_run", lambda cmd: answers[cmd[0]])
    assert lifecycle.job_state("7") == "TIMEOUT"
    answers["sacct"] = "7|CANCELLED by 0\n"
    assert lifecycle.job_state("7") == "CANCELLED"


def _rows(metrics: Path) -> list[dict]:
    return [json.loads(r) for r in metrics.read_text().splitlines()] if metrics.exists() else []


def _wait_for_row(metrics: Path, job_id: str, run_dir: Path, done: Callable[[list[dict]], bool]) -> None:
    deadline = time.monotonic() + 300
    while not done(_rows(metrics)):
        assert time.monotonic() < deadline, "no training step within 300 s"
        state = lifecycle.job_state(job_id, run_dir)
        assert state.split()[0] in lifecycle.ACTIVE, state  # a requeue passes through COMPLETING
        time.sleep(0.2)


def test_usr2_saves_requeues_and_resumes_there_then_sigterm_saves_and_stops(slurm_cluster, tmp_path):
    """The time-limit/preemption signal (USR2, what `--signal=USR2@...` sends) mid-run: the driver
    checkpoints the step it is in (no checkpoint is due: period 100), submitit requeues the job, and
    the next attempt brings Ray up again and resumes from exactly that step. Then `hpcrl cancel`, which
    sends a running job SIGTERM alone (``scancel --signal=TERM``; issue 37 item 5; Slurm sends it to
    every process of the job's steps, Ray's too): the driver saves the step it is in and the job ends
    with 143 and one line, not requeued. Issue 38 item 4: the job is
    heterogeneous (the rollout node from another partition than the training node, a component each):
    the signals, the requeue and Ray work across the components. One job for both: CI time."""
    result = run_cli(
        "submit",
        "+experiment=grpo-tiny-2n1g-fsdp-hetjob",
        f"run.output_root={tmp_path}",
        "algo.max_steps=40",
        "checkpoint.period=100",
        "algo.val_period=4",
        "algo.num_prompts_per_step=16",
    )
    assert result.returncode == 0, result.stderr
    job_id = re.search(r"^job\s+(\d+)", result.stdout, re.M).group(1)
    run_dir = lifecycle.run_dir_of(job_id, tmp_path)
    metrics = run_dir / "metrics.jsonl"
    _wait_for_row(metrics, job_id, run_dir, lambda rows: any(r["step"] >= 1 for r in rows))
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    logged = max(r["step"] for r in _rows(metrics))  # steps done at the signal
    ready_again = run_dir / "ray" / f"ready-{job_id}.r1.json"  # a second attempt bootstrapped Ray
    # USR2 saved logged + 1 or + 2 (see below): logged + 3 was trained by the second attempt
    _wait_for_row(
        metrics, job_id, run_dir, lambda rows: ready_again.exists() and rows[-1]["step"] > logged + 2
    )
    cancelled = run_cli("cancel", job_id, "--root", str(tmp_path))  # its tasks run: SIGTERM alone
    assert f"cancelled {job_id} with SIGTERM: it saves the step in flight, then ends" in cancelled.stdout, (
        cancelled.stdout + cancelled.stderr
    )
    term_at = max(r["step"] for r in _rows(metrics))
    state = lifecycle.wait(job_id, run_dir, timeout_s=480)
    logs = run_cli("logs", job_id, "--root", str(tmp_path)).stdout
    saved = int(re.search(r"stopping after step (\d+) on the scheduler's warning signal", logs).group(1))
    assert logged <= saved < 40 and f"saved step {saved}; requeueing" in logs, (logged, logs[-3000:])
    # The driver stops after the step in flight when the handler asks, not when the test sent the signal
    # (slurmctld's delivery takes about as long as a 0.3 s step here). The head task prints both, in order:
    # k, the last step printed before the ask; k+1 was in flight, unless its end had already read "not
    # asked" (then k+2 saves).
    head = logs[: logs.index("warning signal: saving after the current step")]
    before = [int(s) for s in re.findall(r"\] step +(\d+)/40 \|", head)]
    assert saved in (before[-1] + 1, before[-1] + 2), (before, saved, logs[-3000:])
    assert re.search(rf"resumed from \S+step_{saved:06d} \(step {saved}\)", logs), logs[-3000:]
    # SIGTERM: saved after the step in flight, one line, exit 143 (a person stopped it: no requeue)
    stopped = re.search(
        r"hpcrl: stopped after step (\d+) on SIGTERM \(scancel or kill\); its checkpoint is saved", logs
    )
    assert stopped and state.startswith("FAILED"), (state, logs[-3000:])
    last = int(stopped.group(1))
    assert term_at <= last < 40 and (run_dir / "checkpoints" / f"step_{last:06d}").is_dir(), (term_at, last)
    assert not (run_dir / "ray" / f"ready-{job_id}.r2.json").exists()
    assert "Traceback" not in logs[logs.index("SIGTERM (scancel or kill): saving") :], logs[-3000:]
    assert "task 0: Exited with exit code 143" in logs, logs[-3000:]  # the head's, as srun saw it
    rows = _rows(metrics)
    # each step once (0: the validation before the first)
    assert rows[-1]["step"] == last and [r["step"] for r in rows] == list(range(last + 1))
    parts = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "JobID,Partition"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert sorted(parts) == [f"{job_id}+0|urgent", f"{job_id}+1|debug"], parts


HOLD_GCS_PORT = (
    "import socket, sys\n"
    "s = socket.socket(); s.bind(('0.0.0.0', 1200)); s.listen()\n"
    "print('listening', flush=True); sys.stdin.read()"
)
FAKE_NVIDIA_SMI = (
    "#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-fake-0)'\necho 'GPU 1: NVIDIA H200 (UUID: GPU-fake-1)'\n"
)
NODE2_FAILS = [["pass", "hpcrl-node1"], ["FAIL", "hpcrl-node2"], ["pass", "hpcrl-node3"]]


def _in_node(conf: str, node: int, *argv: str) -> None:
    """Run ``argv`` in one namespace node's mount namespace: `ip netns exec` gives every slurmd its own,
    and the job steps inherit it, so what is mounted there only that node's tasks see."""
    pid = (Path(conf).parents[1] / "run" / f"slurmd-hpcrl-node{node}.pid").read_text().strip()
    subprocess.run(["nsenter", f"--target={pid}", "--mount", *argv], check=True)


def _mount(undo: contextlib.ExitStack, conf: str, node: int, target: Path | str, *how: str) -> None:
    _in_node(conf, node, "mount", *how, str(target))
    undo.callback(_in_node, conf, node, "umount", str(target))


def _break_node2(undo: contextlib.ExitStack, conf: str, tmp_path: Path) -> None:
    """hpcrl-node2 fails every check of a CPU plan whose run.output_root is ``out``, data.source is in
    ``data``, checkpoint.dir is ``ckpt`` and NCCL_SOCKET_IFNAME is ``ib``; nodes 1 and 3 get a bridge
    ``ib0`` and, for a GPU plan with IMEX channel 0, the fakes in ``fake_bin`` and ``fake_imex``."""
    holder = subprocess.Popen(
        ["ip", "netns", "exec", "hpcrl-node2", sys.executable, "-c", HOLD_GCS_PORT],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    undo.callback(holder.wait)
    undo.callback(holder.kill)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "listening"
    for hidden in ("out", "ckpt", "data"):  # 64 kB: less than a tiny checkpoint
        _mount(undo, conf, 2, tmp_path / hidden, "-t", "tmpfs", "-o", "size=64k", "hpcrl-test")
    torch_meta = next(f for f in metadata.files("torch") or [] if f.name == "METADATA").locate()
    other = tmp_path / "METADATA"
    other.write_text(re.sub(r"(?m)^Version: .*$", "Version: 1.0.0", Path(torch_meta).read_text(), count=1))
    _mount(undo, conf, 2, torch_meta, "--bind", str(other))
    imex = Path(IMEX_DIR)
    if not imex.exists():  # a mount point for nodes 1 and 3 (empty: node2 has no channel)
        imex.mkdir()
        undo.callback(imex.rmdir)
    for node in (1, 3):
        _mount(undo, conf, node, tmp_path / "bin", "--bind", str(tmp_path / "fake_bin"))
        _mount(undo, conf, node, imex, "--bind", str(tmp_path / "fake_imex"))
        link = ["ip", "-n", f"hpcrl-node{node}", "link"]
        subprocess.run([*link, "add", "ib0", "type", "bridge"], check=True)
        undo.callback(subprocess.run, [*link, "del", "ib0"], check=True)


def _hold_three_nodes(undo: contextlib.ExitStack, components: bool = False) -> str:
    """Three nodes held by a sleeping job; ``components``: a heterogeneous job of a component a node,
    hpcrl-node1, 2 and 3 in component order (node ids 0, 1 and 2 of a step over all three)."""
    each = ["-p", "debug", "-t", "5", "-o", "/dev/null"]
    shape = [*each, "-N", "3"]
    if components:
        shape = [*each, "-N", "1", "-w", "hpcrl-node1"]
        shape += [arg for node in (2, 3) for arg in (":", *each, "-N", "1", "-w", f"hpcrl-node{node}")]
    job = subprocess.run(
        ["sbatch", "--parsable", *shape, "--wrap", "sleep 300"], capture_output=True, text=True, check=True
    )
    held = job.stdout.strip()
    undo.callback(subprocess.run, ["scancel", held], check=False)
    deadline = time.monotonic() + 60
    while lifecycle.job_state(held) != "RUNNING":
        assert time.monotonic() < deadline, "the allocation never started"
        time.sleep(0.2)
    return held


def _assert_only_node2_fails(stdout: str, expected: dict[str, tuple[str, ...]]) -> None:
    """Each check in ``expected``: nodes 1 and 3 pass, node2's line fails and holds every text given."""
    lines: dict[str, list[str]] = {}
    for line in stdout.splitlines():  # sorted by node, in the order the checks ran
        lines.setdefault(line.split()[2], []).append(line)
    for check, texts in expected.items():
        assert [line.split()[:2] for line in lines[check]] == NODE2_FAILS, (check, stdout)
        assert all(text in lines[check][1] for text in texts), (check, texts, lines[check][1])


def test_doctor_names_the_node_that_fails_each_check_and_the_job_ends_before_ray(
    slurm_cluster, tmp_path, monkeypatch
):
    """Issue 21 item 6: hpcrl-node2 is made to fail every check, for real, in its own namespaces: a
    tmpfs hides run.output_root (shared) and the data file (paths), a 64 kB tmpfs is checkpoint.dir
    (disk), a copy of torch's metadata with another version is bound over the real one (versions), a
    process holds Ray's GCS port (ports), and only nodes 1 and 3 have an interface matching
    NCCL_SOCKET_IFNAME=ib (a bridge `ib0`; nccl). GPUs and IMEX are FAKES (no GPUs, no IMEX driver
    here): a second run, on a heterogeneous job of a component a node (issue 38), plans a 2-GPU rollout
    node, a 4-GPU training node and a 2-GPU judge node, H200s with IMEX channel 0, and nodes 1 and 3 alone
    get a fake `nvidia-smi` listing two GPUs on PATH and a directory holding a plain file `channel0` bound
    at the IMEX path. `hpcrl doctor --job` fails node2's line of each check, with the fix, and passes the
    others (each node checked as its own role's); then a submitted job ends at its first step (the
    doctor) naming node2, before Ray."""
    for folder in ("out", "ckpt", "data", "bin", "fake_bin", "fake_imex"):
        (tmp_path / folder).mkdir()
    out, ckpt, source = tmp_path / "out", tmp_path / "ckpt", tmp_path / "data" / "train.jsonl"
    source.write_text(
        "".join(json.dumps({"problem": f"{i}+1?", "answer": str(i + 1)}) + "\n" for i in range(8))
    )
    (tmp_path / "fake_bin" / "nvidia-smi").write_text(FAKE_NVIDIA_SMI)
    (tmp_path / "fake_bin" / "nvidia-smi").chmod(0o755)
    (tmp_path / "fake_imex" / "channel0").write_text("")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")  # empty but on nodes 1 and 3
    with contextlib.ExitStack() as undo:
        _break_node2(undo, slurm_cluster, tmp_path)
        held = _hold_three_nodes(undo)
        # beside it (a core of each node), a heterogeneous job (issue 38) of a component a node
        het = _hold_three_nodes(undo, components=True)
        doctor = ["doctor", "--job", held, "cluster=slurmtest", f"run.output_root={out}"]
        cpu = run_cli(
            *doctor,
            "data=math500",
            f"data.source={source}",
            f"checkpoint.dir={ckpt}",
            "+cluster.env.NCCL_SOCKET_IFNAME=ib",
        )
        # the container image: no pyxis here, so srun refuses the image flag before any check runs, as it
        # ends when an image does not start; doctor says so in one line naming the job and the fix
        image = run_cli(*doctor, f"cluster.container.image={tmp_path / 'missing.sqsh'}")
        # on the heterogeneous job, a GPU plan of a 2-GPU rollout node, a 4-GPU training node and a 2-GPU
        # judge node: srun reaches every component and each node checks its own role's GPUs
        gpu = run_cli(
            "doctor",
            "--job",
            het,
            "+experiment=grpo-tiny-3n1g-fsdp-judge-hetjob",
            f"run.output_root={out}",
            "cluster.gpu=H200",
            "cluster.gpus_per_node=4",
            "cluster.rollout_node.gpus_per_node=2",
            "cluster.judge_node.gpus_per_node=2",
            "cluster.imex.enabled=true",
            "cluster.imex.channel=0",
        )
        subprocess.run(["scancel", held, het], check=False)  # the nodes for the job submitted below
        assert cpu.returncode == 1, cpu.stdout + cpu.stderr
        checks = [line.split()[2] for line in cpu.stdout.splitlines()]
        assert checks == 3 * ["gpus", "nccl", "versions", "paths", "disk", "ports", "shared"], cpu.stdout
        assert sum(line.startswith("pass") for line in cpu.stdout.splitlines()) == 15  # gpus: a CPU plan
        _assert_only_node2_fails(
            cpu.stdout,
            {
                "nccl": (
                    "NCCL_SOCKET_IFNAME=ib matches none of this node's interfaces (eth0, lo); fix: change it",
                ),
                "versions": (
                    f"torch 1.0.0 (pin {pins('cpu')['torch']}) against the 'cpu' extra; fix: rebuild",
                ),
                "paths": (f"not readable here: data.source={source}; fix: mount the shared filesystem",),
                "disk": (f"65.5 kB free at {ckpt}, checkpoints need ", "; fix: free space there"),
                "ports": ("Ray's ports in use: 1200 (python); fix: another job or a stale Ray",),
                "shared": (
                    f"cannot see {out}/.doctor/{held}-",
                    "; fix: run.output_root must be on a filesystem",
                ),
            },
        )
        assert gpu.returncode == 1, gpu.stdout + gpu.stderr
        _assert_only_node2_fails(
            gpu.stdout,
            {
                "gpus": ("0 GPUs, plan wants 4; fix: ask Slurm for them",),  # the training node
                "imex": (
                    f"{IMEX_DIR}/channel0: missing or not writable; fix: the job needs an IMEX channel",
                ),
            },
        )
        for node in (1, 3):  # the rollout and judge nodes: their kinds' own GPUs, not cluster.gpus_per_node
            assert f"pass  hpcrl-node{node}  gpus      2 GPUs, plan wants 2" in gpu.stdout, gpu.stdout
        assert image.returncode == 1 and image.stdout.count("FAIL") == 1, image.stdout + image.stderr
        start = image.stdout.strip().splitlines()[-1]
        assert start.startswith(f"FAIL  job {held}  start     srun ended with code "), start
        assert (
            "container-image" in start and "fix: check the job is running, cluster.container.image" in start
        )
        assert f"pass  hpcrl-node3  imex      {IMEX_DIR}/channel0 is readable and writable" in gpu.stdout

        jobs = tmp_path / "jobs"
        submitted = run_cli(
            "submit",
            "--smoke",
            "cluster=slurmtest",
            "layout.train_nodes=3",
            "data.max_prompt_tokens=56",  # with 8 new tokens, within the tiny model's 64 positions
            "rollout.max_new_tokens=8",
            f"run.output_root={jobs}",
        )
        assert submitted.returncode == 0, submitted.stderr
        job_id = re.search(r"^job\s+(\d+)", submitted.stdout, re.M).group(1)
        state = lifecycle.wait(job_id, lifecycle.run_dir_of(job_id, jobs), timeout_s=120)
        logs = run_cli("logs", job_id, "--root", str(jobs)).stdout
        assert state == "FAILED", (state, logs[-3000:])
        failed = re.search(r"node 1 \(hpcrl-node2\) failed hpcrl doctor: (.*)", logs)
        assert failed and "FAIL  hpcrl-node2  versions" in failed.group(1), logs[-3000:]
        assert "FAIL  hpcrl-node2  ports" in failed.group(1) and "Ray ready" not in logs
