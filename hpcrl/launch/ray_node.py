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
    p.add_argument("--dashboard-host", default="127.0.0.1")
    p.add_argument("--dashboard-port", type=int)
    return p.parse_args(argv)


def start(args: argparse.Namespace) -> object:
    """The running ``ray._private.node.Node`` (its processes are this process's children)."""
    import ray._private.node
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
        no_monitor=True,  # the autoscaler's monitor: a Slurm allocation never changes size
        ray_client_server_port=None,
    )
    maybe_enable_token_auth_if_token_available()
    ensure_token_if_auth_enabled(None, create_token_if_missing=False)
    if args.head:
        params.gcs_server_port = args.port
        params.update_if_absent(redis_shard_ports=None, num_redis_shards=None, redis_max_clients=None)
        node = ray._private.node.Node(params, head=True, shutdown_at_exit=True, spawn_reaper=True)
        params.gcs_address = node.address
    else:
        params.gcs_address = args.address
        node = ray._private.node.Node(
            params, head=False, shutdown_at_exit=True, spawn_reaper=True, connect_only=False
        )
    ray._private.utils.write_ray_address(params.gcs_address, args.temp_dir)
    return node


GRACEFUL = {0, signal.SIGTERM, -signal.SIGTERM, 128 + signal.SIGTERM}


def main(argv: list[str]) -> int:
    args = parse(argv)
    node = start(args)
    print(f"hpcrl.ray_node: Ray {'head' if args.head else 'node'} up on {args.node_ip_address}", flush=True)
    while True:
        time.sleep(0.5)
        died = [(kind, p) for kind, p in node.dead_processes() if p.returncode not in GRACEFUL]  # type: ignore[attr-defined]
        if died:
            names = ", ".join(f"{kind} (exit {p.returncode})" for kind, p in died)
            print(f"hpcrl.ray_node: Ray process died: {names}; stopping this node", flush=True)
            node.kill_all_processes(check_alive=False, allow_graceful=False)  # type: ignore[attr-defined]
            os._exit(1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
