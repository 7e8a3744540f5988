"""Run one command (``ray start --block``) so that it cannot outlive the node task that started it.

    python -m hpcrl.launch.reaper -- COMMAND...

The command runs in its own process group. The reaper stops that whole group (SIGTERM, then SIGKILL
after 3 s) when it is signalled (job cancelled, out of time, the task stopping Ray) or when its parent,
the node task, disappears — even if the task died in a way that ran no cleanup (Ray's own signal
handler aborts the driver process on SIGTERM). It exits with the command's code when the command ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from types import FrameType

GRACE_S = 3.0


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def main(argv: list[str]) -> int:
    cmd = argv[argv.index("--") + 1 :] if "--" in argv else argv
    parent = os.getppid()
    child = subprocess.Popen(cmd, start_new_session=True)

    def stop(signum: int, _frame: FrameType | None) -> None:
        _kill_group(child.pid)
        child.wait()
        sys.exit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
    while True:
        code = child.poll()
        if code is not None:
            _kill_group(child.pid)  # whatever the command left behind in its group
            return code
        if os.getppid() != parent:  # the node task is gone: nobody will stop Ray but us
            stop(signal.SIGTERM, None)
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
