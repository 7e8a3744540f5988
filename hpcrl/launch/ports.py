"""What listens on this node: read from /proc, so that it works in any namespace without tools."""

from __future__ import annotations

import os
from pathlib import Path


def listening_ports() -> dict[int, str]:
    """TCP ports listening in this node's network namespace (what a site firewall sees of the job),
    each with the name of a process holding it (``?`` where /proc does not say)."""
    inodes: dict[str, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "0A":  # LISTEN
                inodes[fields[9]] = int(fields[1].rsplit(":", 1)[1], 16)
    owners: dict[int, str] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    owners[inodes[target[8:-1]]] = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
    return {port: owners.get(port, "?") for port in sorted(set(inodes.values()))}
