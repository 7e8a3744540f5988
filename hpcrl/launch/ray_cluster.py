"""Ray inside a Slurm job, started from Python on every node (no bash launcher).

Node 0 starts the head, the others join it; everyone runs Ray's node processes as a blocking child
(``hpcrl.launch.ray_node``, what ``ray start --block`` does without Ray's CLI) so a dying Ray is noticed
at once (the task exits non-zero and srun's --kill-on-bad-exit ends the job).
Ports are pinned below 9000, every node has its own temp dir, token auth is on with a per-job
token file readable only by the user, the dashboard listens on 127.0.0.1, readiness is detected by
polling the cluster for the expected nodes and GPUs under a deadline, never by sleeping.
"""

from __future__ import annotations

import json
import os
import resource
import secrets
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hpcrl.run.actors import role_gpus, role_resources

GCS_PORT = 1200
NODE_MANAGER_PORT = 1301
OBJECT_MANAGER_PORT = 1302
DASHBOARD_AGENT_PORT = 1303  # Ray's defaults for these four are random or above 9000
DASHBOARD_AGENT_GRPC_PORT = 1304
RUNTIME_ENV_AGENT_PORT = 1305
METRICS_EXPORT_PORT = 1306
WORKER_PORTS = (2000, 2999)
DASHBOARD_PORT = 8265
DROP_PREFIXES = ("PMI", "PMIX", "OMPI", "SLURM_CPU_BIND", "SLURM_MPI")


def ray_ports() -> list[list[int]]:
    """The fixed ports the job's Ray listens on, all below 9000, as ranges (``hpcrl doctor`` checks them)."""
    return [
        [GCS_PORT, GCS_PORT],
        [NODE_MANAGER_PORT, METRICS_EXPORT_PORT],
        [DASHBOARD_PORT, DASHBOARD_PORT],
        list(WORKER_PORTS),
    ]


class BootstrapError(RuntimeError):
    pass


@dataclass(frozen=True)
class NodeSpec:
    node_id: int
    role: str
    host: str
    ip: str
    gpus: int


def make_token(run_dir: Path) -> Path:
    """Per-job Ray auth token, 0600, written before the job is submitted."""
    path = run_dir / "ray" / "token"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def auth_env(token: Path) -> dict[str, str]:
    """Token auth for every Ray process and client of one cluster (Ray reads it when first imported)."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}


def ray_env(run_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(DROP_PREFIXES)}
    env.update(auth_env(run_dir / "ray" / "token"))
    env.update(
        {
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_worker_register_timeout_seconds": "120",
        }
    )
    return env


def this_node(roles: list[str], node_gpus: list[int] | None = None) -> NodeSpec:
    """This node of the job: its role and the GPUs it gives Ray, what Slurm made visible to the task,
    at most the plan's count for the node (``node_gpus`` by node index; None or empty: not capped)."""
    node_id = int(os.environ.get("SLURM_NODEID", "0"))
    host = socket.gethostname()
    visible = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]
    # A component's task may inherit the batch script's CUDA_VISIBLE_DEVICES from node 0 where Slurm
    # sets none (a zero-GPU component): the plan's count caps it, and an environment node gives Ray none.
    count = min(len(visible), node_gpus[node_id]) if node_gpus else len(visible)
    gpus = role_gpus(roles[node_id], count)
    return NodeSpec(node_id, roles[node_id], host, socket.gethostbyname(host), gpus)


def cluster_gpus(roles: list[str], node_gpus: list[int], head_gpus: int) -> int:
    """The GPUs the whole Ray cluster must show before the run starts: each node's own (``node_gpus``, the
    plan's by node index; empty: the head's count on every node), none on environment nodes, and none at
    all where the head has none (a CPU cluster)."""
    planned = node_gpus or [head_gpus] * len(roles)
    return sum(role_gpus(r, n) for r, n in zip(roles, planned, strict=True)) if head_gpus else 0


def start_node(spec: NodeSpec, run_dir: Path, head_ip: str, job_id: str) -> subprocess.Popen[bytes]:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(65535, hard), hard))  # Ray opens many sockets
    temp = f"/tmp/hpcrl-ray-{job_id}-{spec.node_id}"  # short: unix socket paths are length-limited
    resources = role_resources(spec.role, spec.gpus)
    # hpcrl.launch.ray_node: `ray start --block` without importing Ray's CLI (~2 s of CPU per node).
    cmd = [
        sys.executable,
        "-m",
        "hpcrl.launch.ray_node",
        f"--node-ip-address={spec.ip}",
        f"--temp-dir={temp}",
        f"--num-gpus={spec.gpus}",
        f"--num-cpus={os.cpu_count() or 1}",
        f"--resources={json.dumps(resources)}",
        "--object-store-memory=200000000",
        f"--node-manager-port={NODE_MANAGER_PORT}",
        f"--object-manager-port={OBJECT_MANAGER_PORT}",
        f"--min-worker-port={WORKER_PORTS[0]}",
        f"--max-worker-port={WORKER_PORTS[1]}",
        f"--dashboard-agent-port={DASHBOARD_AGENT_PORT}",
        f"--dashboard-agent-grpc-port={DASHBOARD_AGENT_GRPC_PORT}",
        f"--runtime-env-agent-port={RUNTIME_ENV_AGENT_PORT}",
        f"--metrics-export-port={METRICS_EXPORT_PORT}",
    ]
    if spec.node_id == 0:
        cmd += [
            "--head",
            f"--port={GCS_PORT}",
            f"--dashboard-port={DASHBOARD_PORT}",
            "--dashboard-host=127.0.0.1",
        ]
    else:
        cmd += [f"--address={head_ip}:{GCS_PORT}"]
    log = open(run_dir / "ray" / f"node{spec.node_id}.log", "ab")  # noqa: SIM115 - lives as long as Ray
    # Under the reaper: Ray cannot outlive this node task, however the task ends (see reaper.py).
    # --hold-term: Ray rides out scancel's SIGTERM while the driver saves (job.py stops it with SIGINT)
    reaped = [sys.executable, "-m", "hpcrl.launch.reaper", "--hold-term", "1", "--", *cmd]
    return subprocess.Popen(reaped, env=ray_env(run_dir), stdout=log, stderr=subprocess.STDOUT)


def wait_for_cluster(
    address: str, nodes: int, gpus: int, deadline_s: float, ray_proc: subprocess.Popen[bytes]
) -> float:
    """Poll the cluster until ``nodes`` nodes and ``gpus`` GPUs are alive; returns the seconds it took."""
    import ray

    start = time.monotonic()
    while True:
        if ray_proc.poll() is not None:
            raise BootstrapError(
                f"Ray on the head node exited with code {ray_proc.returncode} during start-up"
            )
        try:
            if not ray.is_initialized():
                ray.init(address=address, logging_level="ERROR", log_to_driver=False)
            alive = [n for n in ray.nodes() if n["Alive"]]
            if len(alive) >= nodes and sum(n["Resources"].get("GPU", 0) for n in alive) >= gpus:
                return time.monotonic() - start
        except Exception:  # the GCS is not up yet
            pass
        if time.monotonic() - start > deadline_s:
            raise BootstrapError(
                f"only part of the Ray cluster registered after {deadline_s:.0f}s (wanted {nodes} nodes; "
                "cluster.bootstrap.ray_nodes_s)"
            )
        time.sleep(0.2)
