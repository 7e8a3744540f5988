"""Issue 3: seconds from job start to "Ray ready" on the namespace-node Slurm test cluster, hpcrl's
bootstrap beside Ray's own `ray symmetric-run`, for 2 and 4 nodes, measured in the same run.

    tools/slurm-cluster up 4 && export SLURM_CONF=/tmp/hpcrl-slurm/etc/slurm.conf
    .venv/bin/python bench/ray_bootstrap.py [--nodes 2,4 --repeats 3]

Both clocks start in the batch script (`date +%s.%N` before srun) and stop on the head once every node
(and its GPU) has registered: hpcrl's head writes it to ray/ready-<job>.json (token auth on, roles as
resources, placement probe not counted); symmetric-run's entrypoint (run by Ray only after
--min-nodes joined) prints it. Jobs run one at a time on an otherwise idle cluster.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hpcrl.launch import lifecycle  # noqa: E402

PY = sys.executable
SYMMETRIC = """#!/bin/bash
#SBATCH --nodes={n}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=1
#SBATCH -o {out}/%j.out
export JOB_START=$(date +%s.%N)
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -1)
export HEAD_IP=$(getent hosts "$HEAD" | awk '{{print $1}}')
export RAY_USAGE_STATS_ENABLED=0
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={out}/token  # token auth, as hpcrl's bootstrap has
export RAY_ADDRESS=$HEAD_IP:6399  # symmetric-run's readiness check calls ray.init() without an address
export PATH={out}/shim:$PATH  # symmetric-run calls `ray start` / `ray stop`: see SHIM
srun --kill-on-bad-exit=1 bash -c 'exec {py} -m ray.scripts.scripts symmetric-run --address $HEAD_IP:6399 \\
  --min-nodes $SLURM_JOB_NUM_NODES --num-cpus=2 --num-gpus=1 --object-store-memory=200000000 \\
  --temp-dir=/tmp/symm-$SLURM_JOB_ID-$SLURM_NODEID \\
  -- {py} -c "import os,time; print(\\"READY\\", time.time()-float(os.environ[\\"JOB_START\\"]))"'
"""


SHIM = """#!{py}
# `ray` for symmetric-run. Its `ray stop` would stop every Ray process on this machine (all namespace
# nodes share one process table, and other people's Ray too): here `stop` ends only the processes
# whose command line names this job's own temp dir. Everything else goes to the real Ray CLI.
import os, signal, sys
if sys.argv[1:2] == ["stop"]:
    mine = f"/tmp/symm-{{os.environ['SLURM_JOB_ID']}}-"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{{pid}}/cmdline", "rb").read().decode(errors="replace")
        except OSError:
            continue
        if mine in cmd and int(pid) not in (os.getpid(), os.getppid()):
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
    sys.exit(0)
from ray.scripts.scripts import main
sys.exit(main())
"""


def wait_done(job_id: str, run_dir: Path | None) -> str:
    return lifecycle.wait(job_id, run_dir, timeout_s=300)


def hpcrl_once(n: int, out: Path) -> float:
    cmd = [str(Path(PY).with_name("hpcrl")), "submit", "--smoke", "cluster=slurmtest", f"cluster.max_nodes={n}",
           "model=tiny", f"layout.train_nodes={n - 1}", "layout.rollout_nodes=1", f"run.output_root={out}",
           f"run.name=boot{n}"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    job_id = re.search(r"^job\s+(\d+)", done.stdout, re.M).group(1)  # type: ignore[union-attr]
    run_dir = lifecycle.run_dir_of(job_id, out)
    state = wait_done(job_id, run_dir)
    ready = run_dir / "ray" / f"ready-{job_id}.json"
    if state != "COMPLETED" or not ready.exists():
        raise RuntimeError(f"hpcrl job {job_id} ended {state}; see {run_dir}")
    return float(json.loads(ready.read_text())["since_job_start_s"])


def reap_symmetric() -> int:
    """Stop what symmetric-run jobs leave behind once the job ended (its client server and agents: their
    command line or environment names the benchmark's GCS address, port 6399): their process groups."""
    groups = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            env = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
            if ":6399" in cmd or "/tmp/symm-" in cmd or "RAY_ADDRESS=10.77.0.11:6399" in env:
                groups.add(os.getpgid(int(pid)))
        except (OSError, ProcessLookupError):
            continue
    for pgid in groups - {os.getpgid(0)}:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
    return len(groups)


def symmetric_once(n: int, out: Path) -> float:
    script = out / f"symmetric-{n}.sh"
    script.write_text(SYMMETRIC.format(n=n, out=out, py=PY))
    done = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=True)
    job_id = done.stdout.strip().split(";")[0]
    state = wait_done(job_id, None)
    leftover = reap_symmetric()
    if leftover:
        print(
            f"    (stopped {leftover} process group(s) symmetric-run job {job_id} left running)", flush=True
        )
    log = (out / f"{job_id}.out").read_text()
    match = re.search(r"READY ([0-9.]+)", log)
    if match is None:
        raise RuntimeError(f"symmetric-run job {job_id} ended {state} without READY:\n{log[-2000:]}")
    return float(match.group(1))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--nodes", default="2,4")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    sizes = [int(n) for n in args.nodes.split(",")]
    out = Path(tempfile.mkdtemp(prefix="hpcrl-boot-"))
    import secrets

    fd = os.open(out / "token", os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, secrets.token_hex(32).encode())
    os.close(fd)
    (out / "shim").mkdir()
    (out / "shim" / "ray").write_text(SHIM.format(py=PY))
    (out / "shim" / "ray").chmod(0o755)
    results: dict[str, dict[int, list[float]]] = {
        "hpcrl": {n: [] for n in sizes},
        "symmetric-run": {n: [] for n in sizes},
    }
    for rep in range(args.repeats):
        for n in sizes:  # interleaved, so drift in machine load hits both alike
            for name, fn in (("hpcrl", hpcrl_once), ("symmetric-run", symmetric_once)):
                seconds = fn(n, out)
                results[name][n].append(seconds)
                print(f"rep {rep} {name:14s} {n} nodes: {seconds:6.1f} s", flush=True)
                time.sleep(2)
    med = {k: {n: statistics.median(v) for n, v in d.items()} for k, d in results.items()}
    print(f"\n{'nodes':>5} {'hpcrl s':>9} {'symmetric-run s':>16} {'hpcrl/symmetric':>16}")
    for n in sizes:
        print(
            f"{n:>5} {med['hpcrl'][n]:9.1f} {med['symmetric-run'][n]:16.1f} {med['hpcrl'][n] / med['symmetric-run'][n]:16.2f}"
        )
    if len(sizes) > 1:
        a, b = sizes[0], sizes[-1]
        for k in med:
            print(f"growth {a}->{b} nodes, {k}: {med[k][b] / med[k][a]:.2f}x")
    print(json.dumps({"medians_s": med, "all_s": results, "repeats": args.repeats}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
