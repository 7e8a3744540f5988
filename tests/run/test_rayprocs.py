"""A local run's Ray rides out a SIGTERM to the run's whole process group (``run/rayprocs.py``): after it,
the driver still moves objects through the object store and starts actors (the GCS and raylet are up),
and ``shutdown`` leaves none of Ray's processes behind."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys, time
    import ray
    from hpcrl.run import rayprocs

    got = []
    signal.signal(signal.SIGTERM, lambda *_: got.append(1))  # the driver's own handler (preempt.py's)
    rayprocs.start_holding_term(lambda: ray.init(
        num_cpus=1, include_dashboard=False, _node_ip_address="127.0.0.1", _temp_dir=sys.argv[1],
        log_to_driver=False))

    @ray.remote
    class A:
        def pid(self): return os.getpid()
        def blob(self): return b"x" * 5_000_000  # through the object store (the raylet's)

    a = A.remote()
    pids = [ray.get(a.pid.remote())]
    os.killpg(os.getpgrp(), signal.SIGTERM)  # as scancel or `kill -TERM -PGID`: every process of the run
    time.sleep(5)  # Ray's GCS and raylet stopped within 1 s of it when they did
    sizes = [len(ray.get(a.blob.remote(), timeout=60))]
    b = A.remote()  # a new actor: the GCS schedules it, the raylet starts its worker
    pids.append(ray.get(b.pid.remote(), timeout=60))
    node = ray._private.worker._global_node
    procs = [info.process.pid for infos in node.all_processes.values() for info in infos] + pids
    rayprocs.shutdown()
    time.sleep(2)
    left = [p for p in procs if os.path.exists(f"/proc/{p}")
            and open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"]
    print(json.dumps({"handler": len(got), "sizes": sizes, "procs": len(procs), "left": left}))
    """
)


def test_rays_processes_ride_out_a_group_sigterm_and_shutdown_leaves_none():
    temp = tempfile.mkdtemp(prefix="rp-", dir="/tmp")  # short: Ray's socket paths are length-limited
    try:
        out = _run(temp)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["handler"] == 1  # the driver's handler got it (ray.init's would have aborted)
    assert seen["sizes"] == [5_000_000]
    assert seen["procs"] >= 6  # GCS, raylet and the others, two actors' workers
    assert seen["left"] == []


def _run(temp: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, temp],
        capture_output=True,
        text=True,
        timeout=240,
        start_new_session=True,  # its own process group: the SIGTERM stays inside it
    )
