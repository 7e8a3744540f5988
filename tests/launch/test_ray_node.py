"""hpcrl.launch.ray_node on loopback: a head and a worker with role resources register; a dead raylet
ends its node's launcher with a message; the reaper leaves no Ray process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl.trainer.process_group import free_port

pytestmark = pytest.mark.slow

CLIENT = """
import json, sys, time, ray
deadline = time.time() + 90
while True:
    try:
        ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
        break
    except Exception:
        if time.time() > deadline:
            raise
        time.sleep(0.5)
while len([n for n in ray.nodes() if n["Alive"]]) < 2 and time.time() < deadline:
    time.sleep(0.2)
print(json.dumps(sorted(sorted(k for k in n["Resources"] if k.startswith("hpcrl") or k == "GPU")
                        for n in ray.nodes() if n["Alive"])))
"""


def _node(tmp: Path, name: str, *args: str) -> subprocess.Popen[bytes]:
    ports = [str(free_port()) for _ in range(2)]
    low = free_port()
    cmd = [
        sys.executable,
        "-m",
        "hpcrl.launch.reaper",
        "--hold-term",  # as ray_cluster.start_node starts it in a job
        "1",
        "--",
        sys.executable,
        "-m",
        "hpcrl.launch.ray_node",
        "--node-ip-address=127.0.0.1",
        f"--temp-dir={tmp / name}",
        "--num-cpus=1",
        "--object-store-memory=80000000",
        f"--node-manager-port={ports[0]}",
        f"--object-manager-port={ports[1]}",
        f"--min-worker-port={low}",
        f"--max-worker-port={low + 30}",
        *args,
    ]
    log = open(tmp / f"{name}.log", "wb")  # noqa: SIM115 - closed with the test's tmp dir
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(), start_new_session=True)


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_AUTH_MODE": "disabled",
    }


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _group_of(tmp: Path, name: str) -> list[tuple[int, str]]:
    """(pid, command line) of every process in the node's Ray process group: the reaper starts the
    launcher in a group of its own, and every Ray process the launcher starts stays in it."""
    rows = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            rows.append((int(pid), os.getpgid(int(pid)), args))
        except (OSError, ProcessLookupError):
            continue
    launcher = [
        pid
        for pid, _, args in rows
        if "hpcrl.launch.ray_node" in args and f"--temp-dir={tmp / name} " in args and "reaper" not in args
    ]
    return [(pid, args) for pid, pgid, args in rows if launcher and pgid == launcher[0] and _alive(pid)]


def test_head_and_worker_register_and_a_dead_raylet_stops_its_node():
    tmp = Path(f"/tmp/hpcrl-rn-{os.getpid()}")  # short: Ray's socket paths are length-limited
    tmp.mkdir(parents=True, exist_ok=True)
    gcs = free_port()
    head = _node(
        tmp,
        "head",
        "--head",
        f"--port={gcs}",
        f"--dashboard-port={free_port()}",
        '--resources={"hpcrl_rollout": 1}',
    )
    worker = _node(
        tmp, "worker", f"--address=127.0.0.1:{gcs}", "--num-gpus=1", '--resources={"hpcrl_train": 1}'
    )
    try:
        client = subprocess.run(
            [sys.executable, "-c", CLIENT, f"127.0.0.1:{gcs}"],
            capture_output=True,
            text=True,
            env=_env(),
            timeout=150,
        )
        assert client.returncode == 0, client.stderr[-2000:]
        assert json.loads(client.stdout) == [["GPU", "hpcrl_train"], ["hpcrl_rollout"]]

        head_group = _group_of(tmp, "head")
        assert any("gcs_server" in args for _, args in head_group), head_group
        # no API server (dashboard.py) with the dashboard off; each node's log monitor is started
        # once that node has registered
        assert not any("dashboard/dashboard.py" in args for _, args in head_group), head_group
        for name in ("head", "worker"):
            deadline = time.monotonic() + 30
            while "registered; log monitor started" not in (tmp / f"{name}.log").read_text():
                assert time.monotonic() < deadline, (tmp / f"{name}.log").read_text()[-2000:]
                time.sleep(0.2)
            assert any("log_monitor.py" in args for _, args in _group_of(tmp, name)), name
        worker_group = _group_of(tmp, "worker")
        assert len(worker_group) >= 3, worker_group  # launcher, raylet, agents
        (raylet,) = [pid for pid, args in worker_group if "raylet/raylet" in args]
        os.kill(raylet, signal.SIGKILL)
        assert worker.wait(timeout=30) == 1  # the launcher saw it, stopped the node and exited 1
        assert "Ray process died: raylet" in (tmp / "worker.log").read_text()
        # the launcher's SIGKILL to its group is sent; a loaded machine may take a moment to end them
        deadline = time.monotonic() + 10
        while [pid for pid, _ in worker_group if _alive(pid)] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [pid for pid, _ in worker_group if _alive(pid)] == []

        for pid, _ in head_group:  # scancel's SIGTERM reaches every process: Ray rides it out
            os.kill(pid, signal.SIGTERM)
        head.send_signal(signal.SIGTERM)
        time.sleep(2)
        assert head.poll() is None and all(_alive(pid) for pid, _ in head_group), head_group
        head.send_signal(signal.SIGINT)  # what a node task's _stop does
        assert head.wait(timeout=30) == 128 + signal.SIGINT
        alive = [pid for pid, _ in head_group if _alive(pid)]
        assert alive == []  # GCS, raylet, agents: the whole group
    finally:  # also when an assertion failed: the reaper stops its launcher's group on SIGINT
        leftovers = [pid for name in ("head", "worker") for pid, _ in _group_of(tmp, name)]
        for proc in (head, worker):
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
        for pid in leftovers:  # whatever outlived the reaper (it should be nothing)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        subprocess.run(["rm", "-rf", str(tmp)], check=False)
