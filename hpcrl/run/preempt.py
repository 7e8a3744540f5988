"""Save now, stop, resume later: what a run does on Slurm's warning signal.

Slurm sends USR2 ``cluster.slurm.signal_delay_s`` seconds before a time limit or a preemption kill
(``--signal=USR2@delay``). The signal handler cannot write a checkpoint itself — the driver is in the
middle of a step, and a checkpoint taken there would pair new weights with an old step count — so it
asks: ``REQUEST.ask()``. The loop checks after every step; when asked, it writes a checkpoint of the
step it just finished (unless that step was saved already), says so with ``REQUEST.done(step)`` and
stops with ``Preempted``. The next attempt resumes from that checkpoint: no step is redone.

On Slurm the driver runs in a thread so that the main thread can take the signal and wait (bounded
by the warning time) for the save before submitit requeues the job; a local run stops with
exit code 75 (EX_TEMPFAIL: run again with the same ``run.dir`` to resume).
"""

from __future__ import annotations

import threading

EXIT_PREEMPTED = 75


class Preempted(Exception):
    def __init__(self, step: int) -> None:
        super().__init__(f"stopped after step {step} on request; its checkpoint is saved")
        self.step = step
        self.run_dir: str | None = None
        """Filled in by whoever knows it (the local runner), for the resume hint."""


class SaveRequest:
    def __init__(self) -> None:
        self._asked = threading.Event()
        self._done = threading.Event()
        self.step: int | None = None

    def ask(self) -> None:
        """From a signal handler: save at the end of the current step and stop."""
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


REQUEST = SaveRequest()
"""One per process: the driver's loop and the signal handler share it."""
