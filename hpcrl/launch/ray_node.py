"""Start this node's Ray processes and block while they live: ``ray start --block`` without Ray's CLI.

    python -m hpcrl.launch.ray_node --head --port 1200 --node-ip-address IP ...
    python -m hpcrl.launch.ray_node --address HEAD:1200 --node-ip-address IP ...

``ray start`` imports Ray's whole command tree (click, Serve, the cluster launcher) before it starts
anything: ~2 s of CPU on every node, three times what the node's own start costs, and it lands on
the critical path of the whole bootstrap when nodes share CPUs (a busy login-shared node, or our
namespace test cluster, where it made the 2 -> 4 node growth CPU-bound). This module builds the same
``RayParams`` and ``Node`` that ``ray start`` builds, with what a fixed-size Slurm allocation wants:
no autoscaler monitor, no Ray Client server (drivers connect to the GCS address), dashboard off.

While blocking it watches the node's processes as ``ray start --block`` does: if one dies with an
unexpected code it stops the rest and exits 1, so the node task sees Ray gone at once.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Any


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hpcrl.launch.ray_node")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--head", action="store_true", help="start the head (GCS) on this node")
    where.add_argument("--address", help="the head's GCS address host:port, for a worker node")
    p.add_argument("--port", type=int, default=6379, help="GCS port (head)")
    p.add_argument("--node-ip-address", required=True)
    p.add_argument("--temp-dir", required=True)
    p.add_argument("--num-cpus", type=int, required=True)
    p.add_argument("--num-gpus", type=int, default=0)
    p.add_argument("--resources", default="{}", help="JSON object of custom resources")
    p.add_argument("--object-store-memory", type=int)
    p.add_argument("--node-manager-port", type=int, default=0)
    p.add_argument("--object-manager-port", type=int)
    p.add_argument("--min-worker-port", type=int)
    p.add_argument("--max-worker-port", type=int)
    p.add_argument("--dashboard-agent-port", type=int, help="the dashboard agent's HTTP port")
    p.add_argument(
        "--dashboard-agent-grpc-port", type=int, help="the dashboard agent's gRPC (metrics agent) port"
    )
    p.add_argument("--runtime-env-agent-port", type=int)
    p.add_argument("--metrics-export-port", type=int)
    p.add_argument("--dashboard-host", default="127.0.0.1")
    p.add_argument("--dashboard-port", type=int)
    return p.parse_args(argv)


def node_class() -> type:
    """Ray's ``Node``, minus the API server when the dashboard is off."""
    import ray._private.node

    class SlurmNode(ray._private.node.Node):
        def start_api_server(self, *, include_dashboard: bool | None, raise_on_failure: bool) -> None:
            # With the dashboard off, Ray's API server loads only its usage-stats module (usage stats
            # are off here) — yet the head waits for it to come up before it starts its raylet:
            # ~2 s of CPU on the head's critical path. Skipped; nothing else reads it.
            if include_dashboard:
                super().start_api_server(
                    include_dashboard=include_dashboard, raise_on_failure=raise_on_failure
                )
            else:
                self._webui_url = ""

    return SlurmNode


def start(args: argparse.Namespace) -> object:
    """The running ``ray._private.node.Node`` (its processes are this process's children)."""
    import ray._private.utils
    from ray._private.authentication.authentication_token_setup import (
        ensure_token_if_auth_enabled,
        maybe_enable_token_auth_if_token_available,
    )
    from ray._private.parameter import RayParams

    params = RayParams(
        node_ip_address=args.node_ip_address,
        node_name=args.node_ip_address,
        min_worker_port=args.min_worker_port,
        max_worker_port=args.max_worker_port,
        object_manager_port=args.object_manager_port,
        node_manager_port=args.node_manager_port,
        object_store_memory=args.object_store_memory,
        num_cpus=args.num_cpus,
        num_gpus=args.num_gpus,
        resources=json.loads(args.resources),
        labels={},
        temp_dir=args.temp_dir,
        include_dashboard=False,
        dashboard_host=args.dashboard_host,
        dashboard_port=args.dashboard_port,
        dashboard_agent_listen_port=args.dashboard_agent_port,
        metrics_agent_port=args.dashboard_agent_grpc_port,
        runtime_env_agent_port=args.runtime_env_agent_port,
        metrics_export_port=args.metrics_export_port,
        no_monitor=True,  # the autoscaler's monitor: a Slurm allocation never changes size
        include_log_monitor=False,  # started once this node has registered (see main)
        ray_client_server_port=None,
    )
    maybe_enable_token_auth_if_token_available()
    ensure_token_if_auth_enabled(None, create_token_if_missing=False)
    if args.head:
        params.gcs_server_port = args.port
        params.update_if_absent(redis_shard_ports=None, num_redis_shards=None, redis_max_clients=None)
        node = node_class()(params, head=True, shutdown_at_exit=True, spawn_reaper=True)
        params.gcs_address = node.address
    else:
        params.gcs_address = args.address
        node = node_class()(params, head=False, shutdown_at_exit=True, spawn_reaper=True, connect_only=False)
    ray._private.utils.write_ray_address(params.gcs_address, args.temp_dir)
    return node


GRACEFUL = {0, signal.SIGTERM, -signal.SIGTERM, 128 + signal.SIGTERM}
LOG_MONITOR_DEADLINE_S = 60.0
"""Start the log monitor by then even if registration was not seen (the GCS slow to answer)."""


def registered(node: Any) -> bool:
    """Whether this node's raylet is alive in the GCS (it registers once its dashboard agent is up)."""
    try:
        infos = node.get_gcs_client().get_all_node_info(timeout=1).values()
    except Exception:  # the GCS not reachable yet: not registered
        return False
    return any(
        i.node_manager_port == node.node_manager_port
        and i.node_manager_address == node.node_ip_address
        and i.state == 0
        for i in infos
    )  # 0: ALIVE


def main(argv: list[str]) -> int:
    args = parse(argv)
    node: Any = start(args)
    print(
        f"hpcrl.ray_node: Ray {'head' if args.head else 'node'} started on {args.node_ip_address}", flush=True
    )
    # The log monitor (forwards workers' output to drivers; a Python process, ~1 s of CPU to start) is
    # off the registration path: it starts once this node has registered, so that on shared CPUs it
    # does not slow the raylet and its agents, which every node's registration waits for.
    log_monitor_at = time.monotonic() + LOG_MONITOR_DEADLINE_S
    while True:
        if log_monitor_at and (registered(node) or time.monotonic() > log_monitor_at):
            node.start_log_monitor()
            log_monitor_at = 0.0
            print(f"hpcrl.ray_node: registered; log monitor started on {args.node_ip_address}", flush=True)
        time.sleep(0.2 if log_monitor_at else 0.5)
        died = [(kind, p) for kind, p in node.dead_processes() if p.returncode not in GRACEFUL]
        if died:
            names = ", ".join(f"{kind} (exit {p.returncode})" for kind, p in died)
            print(f"hpcrl.ray_node: Ray process died: {names}; stopping this node", flush=True)
            node.kill_all_processes(check_alive=False, allow_graceful=False)
            os._exit(1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
