"""What runs inside the Slurm job: one submitit task per node.

This first increment checks every node in: it records which node it is (SLURM_NODEID), its role in
the topology, its hostname and the GPUs Slurm gave it, in ``<run dir>/nodes/<id>.json``. The Ray
bootstrap and the RL driver build on the same entry point (issue 3, next increment).
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any


class NodeTask:
    """Picklable callable: submitit runs it once on every node of the allocation."""

    def __init__(self, run_dir: str, roles: list[str]) -> None:
        self.run_dir = run_dir
        self.roles = roles

    def __call__(self) -> dict[str, Any]:
        node_id = int(os.environ.get("SLURM_NODEID", "0"))
        record = {
            "node_id": node_id,
            "role": self.roles[node_id],
            "host": socket.gethostname(),
            "job_id": os.environ.get("SLURM_JOB_ID"),
            "gpus": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
            "time": time.time(),
        }
        out = Path(self.run_dir) / "nodes"
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f".{node_id}.json.tmp"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, out / f"{node_id}.json")
        print(f"hpcrl: node {node_id} ({record['host']}) checked in as {record['role']}", flush=True)
        return record
