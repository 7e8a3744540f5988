"""A pod's preStop hook (``python -m hpcrl.launch.kube_prestop RUN_DIR --wait S``): preemption as Kubernetes
delivers it.

A pod's deletion (a Spot VM's reclaim, a node drain, Kueue preempting the workload, ``kubectl delete``)
runs each container's preStop hook, then sends SIGTERM to the container's PID 1 — ``ray start --block``,
not the driver — and SIGKILL once ``terminationGracePeriodSeconds`` (counted from the deletion) have
passed. So the hook asks the driver to save, through a file in the run directory (on the pods' shared
volume, whichever pod is deleted): ``kube_entry``'s watcher thread turns the request into the save a
SIGTERM to the driver asks for (``run/preempt.py``), and the hook waits, bounded, until the driver has
exited. Waiting keeps this pod's Ray node up meanwhile: the trainer ranks on it write their shards of
that checkpoint.

Files under ``RUN_DIR/preempt/``: ``driver.json`` (a driver runs: written at its start, after clearing
an earlier attempt's files), ``request`` (the pod that asked), ``exited.json`` (the driver's exit code and
the step it saved). No driver (a debug RayCluster, or the driver gone): the hook returns at once.

Standard library only: the hook starts in a pod being deleted, against the grace period."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

STOP_DIR = "preempt"
DRIVER, REQUEST, EXITED = "driver.json", "request", "exited.json"
POLL_S = 1.0


def _write(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)  # whole or absent: the other side polls it


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def ask_and_wait(run_dir: Path, wait_s: float, poll_s: float = 0.5) -> tuple[int, str]:
    """The hook: ask the running driver to save, then wait for its exit; (exit code, one line)."""
    stop = run_dir / STOP_DIR
    if not (stop / DRIVER).exists() or (stop / EXITED).exists():
        return 0, f"no driver runs in {run_dir}: nothing to save"
    pod = socket.gethostname()  # a pod's hostname is its name
    _write(stop / REQUEST, {"pod": pod, "at": time.time()})
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        exited = _read(stop / EXITED)
        if exited is not None:
            step = exited.get("step")
            saved = f"saved step {step}" if step is not None else "saved nothing"
            return 0, f"driver exited {exited.get('code')} ({saved}) after pod {pod}'s request"
        time.sleep(poll_s)
    return 1, f"the driver did not exit within {wait_s:g} s of pod {pod}'s request; the pod is killed now"


@contextmanager
def answering_prestop(
    run_dir: Path, ask: Callable[[str], None], poll_s: float = POLL_S
) -> Iterator[Callable[[int, int | None], None]]:
    """The driver's side, around its loop: clears an earlier attempt's files, says a driver runs, and
    calls ``ask(pod)`` from a thread once a pod's hook asks (every ``poll_s`` while the request stands).
    Yields ``exited(code, step)`` to record how the driver ends; left unset (an exception),
    ``exited.json`` says code 1, no step: the hooks stop waiting either way."""
    stop = run_dir / STOP_DIR
    stop.mkdir(exist_ok=True)
    for name in (REQUEST, EXITED):
        (stop / name).unlink(missing_ok=True)
    _write(stop / DRIVER, {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()})
    ended = threading.Event()
    outcome: dict[str, Any] = {"code": 1, "step": None}

    def watch() -> None:
        # asked again at every poll while the request stands: the driver's loop resets its request
        # when it starts (``run_loop``), which may come after a pod's early deletion
        while not ended.wait(poll_s):
            asked = _read(stop / REQUEST)
            if asked is not None:
                ask(str(asked.get("pod", "?")))

    def exited(code: int, step: int | None) -> None:
        outcome.update(code=code, step=step)

    watcher = threading.Thread(target=watch, name="hpcrl-prestop-watch", daemon=True)
    watcher.start()
    try:
        yield exited
    finally:
        ended.set()
        watcher.join(timeout=poll_s + 1)
        _write(stop / EXITED, outcome)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpcrl.launch.kube_prestop", description=__doc__)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--wait", type=float, required=True, help="seconds to wait for the driver's exit")
    args = parser.parse_args(argv)
    code, line = ask_and_wait(args.run_dir, args.wait)
    print(f"hpcrl preStop: {line}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
