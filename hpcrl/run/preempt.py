"""Save now, stop, resume later: what a run does on Slurm's warning signal.

Slurm sends USR2 ``cluster.slurm.signal_delay_s`` seconds before a time limit or a preemption kill
(``--signal=USR2@delay``). The signal handler cannot write a checkpoint itself — the driver is in the
middle of a step, and a checkpoint taken there would pair new weights with an old step count — so it
asks: ``REQUEST.ask()``. The loop checks after every step; when asked, it writes a checkpoint of the
step it just finished (unless that step was saved already), says so with ``REQUEST.done(step)`` and
stops with ``Preempted``. The next attempt resumes from that checkpoint: no step is redone.

On Slurm the driver runs in a thread so that the main thread can take the signal and wait (bounded
by the warning time) for the save before submitit requeues the job. A driver in the user's shell (a
local run, ``hpcrl run`` in a debug session) does the same on SIGTERM (``scancel``, ``kill``) and SIGINT
(Ctrl-C) as on USR2 (``saving_on_signals``), and exits with the code of the signal that stopped it
(``EXIT_CODES``). A second Ctrl-C stops at once, without the save.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

EXIT_PREEMPTED = 75
EXIT_CODES: dict[int, int] = {
    signal.SIGUSR2: EXIT_PREEMPTED,
    signal.SIGTERM: 128 + signal.SIGTERM,
    signal.SIGINT: 130,
}
"""How a saved stop exits. USR2 (the time limit or a preemption is near): 75, EX_TEMPFAIL, "run again"
(what ``RequeueExit=75`` in slurm.conf would requeue). SIGTERM and SIGINT: the shell's 128 + signal,
143 and 130: a person stopped the run, and nothing should requeue it; the checkpoint is there to resume
from all the same."""
WHY: dict[int, str] = {
    signal.SIGUSR2: "the scheduler's warning signal",
    signal.SIGTERM: "SIGTERM (scancel or kill)",
    signal.SIGINT: "SIGINT (Ctrl-C)",
}


class Preempted(Exception):
    def __init__(self, step: int, signum: int = signal.SIGUSR2) -> None:
        super().__init__(f"stopped after step {step} on {WHY[signum]}; its checkpoint is saved")
        self.step = step
        self.exit_code = EXIT_CODES[signum]
        self.resume: str | None = None
        """How to resume (the override to run again with), filled in by whoever knows it."""


class SaveRequest:
    def __init__(self) -> None:
        self._asked = threading.Event()
        self._done = threading.Event()
        self.step: int | None = None
        self.signum: int = signal.SIGUSR2
        """The signal that asked first (what the stop says, and its exit code)."""

    def ask(self, signum: int = signal.SIGUSR2) -> None:
        """From a signal handler: save at the end of the current step and stop."""
        if not self._asked.is_set():
            self.signum = signum
        self._asked.set()

    @property
    def asked(self) -> bool:
        return self._asked.is_set()

    def done(self, step: int) -> None:
        self.step = step
        self._done.set()

    def wait(self, timeout_s: float) -> bool:
        """True once the loop has saved (within ``timeout_s``)."""
        return self._done.wait(timeout_s)

    def reset(self) -> None:
        self._asked.clear()
        self._done.clear()
        self.step = None
        self.signum = signal.SIGUSR2


REQUEST = SaveRequest()
"""One per process: the driver's loop and the signal handler share it."""


def _ask(signum: int, _frame: FrameType | None) -> None:
    if REQUEST.asked and signum == signal.SIGINT:
        raise KeyboardInterrupt  # Ctrl-C again: stop now (the driver's cleanup still runs)
    if not REQUEST.asked:
        print(
            f"hpcrl: {WHY[signum]}: saving after the current step, then stopping"
            + (" (Ctrl-C again: stop now, unsaved)" if signum == signal.SIGINT else ""),
            file=sys.stderr,
            flush=True,
        )
    REQUEST.ask(signum)


_armed = threading.Event()


@contextmanager
def saving_on_signals() -> Iterator[None]:
    """While a driver runs in this (main) thread: USR2, SIGTERM and SIGINT each save after the
    current step and stop (``Preempted``), instead of killing the driver mid-step with tracebacks
    from it and Ray."""
    previous = {sig: signal.signal(sig, _ask) for sig in WHY}
    _armed.set()
    try:
        yield
    finally:
        _armed.clear()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def rearm() -> None:
    """Put the handlers back after ``ray.init``, which replaces SIGTERM's with one that dumps the
    stack and aborts the driver. Only where ``saving_on_signals`` armed them (a driver in a thread,
    as in a Slurm job, leaves the signals to the main thread)."""
    if _armed.is_set() and threading.current_thread() is threading.main_thread():
        for sig in WHY:
            signal.signal(sig, _ask)
