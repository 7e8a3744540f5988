"""Run one command (``ray start --block``) so that it cannot outlive the node task that started it.

    python -m hpcrl.launch.reaper [--watch PID] [--grace SECONDS] [--hold-term 1] -- COMMAND...

The command runs in its own process group. The reaper stops that whole group (SIGTERM, then SIGKILL
after 3 s) when it is signalled (job cancelled, out of time, the task stopping Ray) or when its parent,
the node task, disappears — even if the task died in a way that ran no cleanup (Ray's own signal
handler aborts the driver process on SIGTERM). It exits with the command's code when the command ends.
``--watch PID`` watches that process instead of the parent: ``hpcrl debug --here`` returns to the
user's shell at once, and its Ray step lives as long as that shell (see ``launch/here.py``).
``--hold-term 1`` (a Slurm job's Ray, ``launch/job.py``): ``scancel`` sends SIGTERM to every process of
the step, and Ray's processes (raylet, GCS, actors) would end at once, before the driver could save the
step it is in. The command starts with SIGTERM blocked (Ray's processes install their own handlers, so
ignoring it would not last; a blocked signal stays blocked across fork and exec), and the reaper
ignores it: the node task stops Ray with SIGINT or SIGHUP, or by ending; the group is then SIGKILLed
(its SIGTERM would wait forever).

Signal handlers only record the request; the main loop does the stopping. Stopping inside the handler
once deadlocked: Slurm signals a cancelled step more than once, and a second handler nested inside the
first one's ``Popen.wait`` blocks forever on the wait lock the first one holds — the reaper then outlived
the job it was meant to clean up.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

GRACE_S = 3.0
POLL_S = 0.2


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie (exited, not yet reaped by its parent) has left."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _kill_group(child: subprocess.Popen[bytes], grace_s: float = GRACE_S) -> None:
    """SIGTERM the child's group, SIGKILL what is left after ``grace_s``; reap the child itself."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        child.poll()  # reap the leader, so a zombie does not count as a live group member
        if not _group_alive(child.pid):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)
    child.wait()


def parse(argv: list[str]) -> tuple[int | None, float, bool, list[str]]:
    """``--watch PID``, ``--grace SECONDS`` and ``--hold-term 1`` before ``--``; the command after it."""
    if "--" not in argv:
        return None, GRACE_S, False, argv
    cut = argv.index("--")
    options = dict(zip(argv[:cut:2], argv[1:cut:2], strict=True))
    watch = options.get("--watch")
    hold = options.get("--hold-term") == "1"
    return (int(watch) if watch else None), float(options.get("--grace", GRACE_S)), hold, argv[cut + 1 :]


def main(argv: list[str]) -> int:
    watch, grace_s, hold_term, cmd = parse(argv)
    parent = os.getppid()
    requested: list[int] = []

    def request_stop(signum: int, _frame: FrameType | None) -> None:
        requested.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, request_stop)
    # Slurm's time-limit/preemption warning (USR2) goes to every process of the job step, and its
    # default action kills. Ray must ride it out while the driver saves a checkpoint: ignored here,
    # and by the command's processes too (an ignored signal stays ignored across exec).
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    if hold_term:  # scancel's SIGTERM: the node task decides when Ray stops (see the module's text)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        grace_s = 0.0
    child = subprocess.Popen(cmd, start_new_session=True)
    if hold_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # discards one that came meanwhile
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    while True:
        code = child.poll()
        if code is not None:
            _kill_group(child, grace_s)  # whatever the command left behind in its group
            return code
        gone = not _alive(watch) if watch else os.getppid() != parent
        if not requested and gone:  # the node task (the user's shell) is gone: nobody else will stop Ray
            requested.append(signal.SIGTERM)
        if requested:
            _kill_group(child, grace_s)
            return 128 + requested[0]
        time.sleep(POLL_S)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
