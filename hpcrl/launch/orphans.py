"""What a local run started dies with it, however it ends.

    python -m hpcrl.launch.orphans WATCHED_PID

A local run's Ray (``ray.init`` in the driver) shares its fate with the driver for its GCS, raylet and
workers, but not for the raylet's agents: after a SIGKILL of the driver (an OOM kill, a ``kill -9``) a
``ray::DashboardAgent`` and a ``ray::RuntimeEnvAgent`` stayed behind as orphans (Ray 2.x, seen minutes
later). This watcher, started by the driver in a session of its own, notes the driver's descendants
while it runs; once the driver is gone it kills those still alive (each checked against its start time,
so that a reused PID is left alone). A Slurm job's Ray runs under ``launch/reaper.py`` instead.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

POLL_S = 0.5


def started(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat), or None when it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else fields[19]


def descendants(root: int) -> dict[int, str]:
    """Every live process below ``root``, with its start time."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    found: dict[int, str] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if (when := started(pid)) is not None and pid != os.getpid():
            found[pid] = when
            todo += children.get(pid, [])
    return found


def watch(pid: int) -> None:
    """Until ``pid`` ends, note its descendants; then kill those left."""
    mine = started(pid)
    seen: dict[int, str] = {}
    while mine is not None and started(pid) == mine:
        seen.update(descendants(pid))
        seen = {p: t for p, t in seen.items() if started(p) == t}
        time.sleep(POLL_S)
    for child, when in seen.items():
        if started(child) == when:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)


def start_watcher() -> None:
    """The watcher of this process, in a session of its own (the terminal's Ctrl-C is the driver's)."""
    subprocess.Popen(
        [sys.executable, "-m", "hpcrl.launch.orphans", str(os.getpid())],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


if __name__ == "__main__":
    watch(int(sys.argv[1]))
