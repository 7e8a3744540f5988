"""Reward pool: verifiers run in separate processes with a hard per-sample time limit.

An adversarial completion that makes SymPy spin, or a verifier that crashes its process, costs
that one sample (scored as timeout/error, counted apart) and a process restart, never the run.
Each process has its own pipe and gets one task at a time, so the parent always knows which task
a process holds and since when: a killed or dead process can never lose a task silently.
How many processes, the time limit and the start-up deadline: ``rewards.*`` (``rewards/config.py``).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from hpcrl.rewards.config import RewardsConfig
from hpcrl.rewards.verifiers import Outcome, Verdict, get_verifier, load_plugins


@dataclass(frozen=True)
class Task:
    index: int
    completion: str
    answer: str
    prompt: str


def _serve(verifier_name: str, plugins: str, conn: Connection) -> None:
    """One reward process: warm up, say READY, then score one task at a time until told to stop."""
    import logging

    logging.disable(logging.WARNING)  # math-verify warns on every call that its own timeouts are off
    import signal

    # Slurm's warning signal (USR2) reaches every process of the step; the driver handles it, and a
    # reward process killed by it would score its sample as an error.
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    load_plugins(plugins)
    verify = get_verifier(verifier_name)
    # Warm up before saying ready: the first call imports and builds the parsers (seconds on a loaded
    # machine), which must not count against the first real sample's time limit.
    with contextlib.suppress(Exception):
        verify("\\boxed{1}", "1", "")
    conn.send(READY)
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        try:
            verdict = verify(task.completion, task.answer, task.prompt)
        except Exception:
            verdict = Verdict(Outcome.error)
        conn.send((task.index, verdict.outcome.value))


READY = ("ready", None)


@dataclass
class _Slot:
    proc: Any
    conn: Connection
    task: int | None = None
    started: float = 0.0
    ready: bool = False
    spawned: float = 0.0


class RewardPool:
    """``verifier`` in ``settings.process_count()`` processes, under the run's ``rewards.*`` limits."""

    def __init__(self, verifier: str, settings: RewardsConfig) -> None:
        self.plugins = os.environ.get("HPCRL_PLUGINS", "")
        load_plugins(self.plugins)
        get_verifier(verifier)  # fail here, in the caller, on an unknown name
        self.verifier, self.timeout_s, self.start_timeout_s = (
            verifier,
            settings.timeout_s,
            settings.start_timeout_s,
        )
        self.ctx = mp.get_context("spawn")  # no fork of a process that holds torch/Ray threads
        self.slots = [self._spawn() for _ in range(settings.process_count())]
        self.restarts = 0

    def _spawn(self) -> _Slot:
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=_serve, args=(self.verifier, self.plugins, child), daemon=True)
        proc.start()
        child.close()
        return _Slot(proc, parent, spawned=time.monotonic())

    def _replace(self, i: int) -> None:
        slot = self.slots[i]
        slot.proc.kill()
        slot.proc.join(timeout=5)
        slot.conn.close()
        self.slots[i] = self._spawn()
        self.restarts += 1

    def score(self, tasks: list[Task]) -> list[Outcome]:
        pending = deque(tasks)
        outcomes: dict[int, Outcome] = {}
        while len(outcomes) < len(tasks):
            for slot in self.slots:
                if slot.ready and slot.task is None and pending:
                    task = pending.popleft()
                    slot.conn.send(task)
                    slot.task, slot.started = task.index, time.monotonic()
            busy = [s.conn for s in self.slots if s.task is not None or not s.ready]
            ready = wait(busy, timeout=0.2)
            for i, slot in enumerate(self.slots):
                if not slot.ready:
                    self._await_ready(i, slot, slot.conn in ready)
                    continue
                if slot.task is None:
                    continue
                if slot.conn in ready:
                    try:
                        index, value = slot.conn.recv()
                    except (EOFError, OSError):  # the process died mid-task
                        outcomes[slot.task] = Outcome.error
                        self._replace(i)
                        continue
                    outcomes[index] = Outcome(value)
                    slot.task = None
                elif time.monotonic() - slot.started > self.timeout_s:
                    outcomes[slot.task] = Outcome.timeout
                    self._replace(i)
        return [outcomes[t.index] for t in tasks]

    def _await_ready(self, i: int, slot: _Slot, readable: bool) -> None:
        """A starting process: ready once it says so; restarted if it died; an error past start_timeout_s."""
        if readable:
            try:
                slot.ready = slot.conn.recv() == READY
            except (EOFError, OSError):
                self._replace(i)
        elif time.monotonic() - slot.spawned > self.start_timeout_s:
            raise RuntimeError(
                f"reward process for verifier {self.verifier!r} did not start within "
                f"{self.start_timeout_s:.0f} s (rewards.start_timeout_s; plugins: {self.plugins or 'none'}); "
                "check that the verifier imports in a fresh process"
            )

    def close(self) -> None:
        for slot in self.slots:
            with contextlib.suppress(OSError, BrokenPipeError):
                slot.conn.send(None)
        for slot in self.slots:
            slot.proc.join(timeout=2)
            if slot.proc.is_alive():
                slot.proc.kill()
            slot.conn.close()
        self.slots = []

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
