"""A local run killed outright (SIGKILL: an OOM kill, ``kill -9``) leaves no Ray process behind: the
watcher (launch/orphans.py) kills what Ray's fate sharing misses (the raylet's agents)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from hpcrl.launch.orphans import started
from tests.conftest import ROOT

DRIVER = """
import os, signal, sys
from pathlib import Path
from hpcrl.launch.local import start_local_ray
from hpcrl.plan.planner import plan_from_overrides
start_local_ray(plan_from_overrides(["model=tiny", "cluster.gpu=cpu"]), Path(sys.argv[1]))
import ray
@ray.remote(num_cpus=0)
class Probe:
    def pid(self):
        return os.getpid()
print(ray.get(Probe.remote().pid.remote()), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def ray_processes_under(scratch: str) -> list[int]:
    """Live processes of the Ray session in ``scratch`` (their logs are open under it)."""
    found = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if started(pid) and any(scratch in os.readlink(f"/proc/{pid}/fd/{fd}") for fd in fds):
                found.append(pid)
        except OSError:
            continue
    return found


@pytest.mark.slow
def test_a_killed_local_driver_leaves_no_ray_process_behind():
    tmp_path = Path(tempfile.mkdtemp(prefix="hpcrl-orphans-"))  # short: Ray's socket paths are limited
    try:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        done = subprocess.run(
            [sys.executable, "-c", DRIVER, str(tmp_path)],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
        actor = int(done.stdout.split()[0])
        deadline = time.monotonic() + 60  # the watcher polls twice a second; Ray's own exits take a moment
        while (left := ray_processes_under(str(tmp_path))) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert left == [] and started(actor) is None, [Path(f"/proc/{p}/cmdline").read_text() for p in left]
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)
