"""Reward pool: verifiers run in separate processes with a hard per-sample time limit.

An adversarial completion that makes SymPy spin, or a verifier that crashes its process, costs
that one sample (scored as timeout/error, counted apart) and a process restart, never the run.
Each process has its own pipe and gets one task at a time, so the parent always knows which task
a process holds and since when: a killed or dead process can never lose a task silently.
A thread of the parent runs the processes, so tasks are scored while the caller waits on something
else (``submit`` now, ``drain`` later): a step's completions are scored as they are generated.
How many processes, the time limit and the start-up deadline: ``rewards.*`` (``rewards/config.py``).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from hpcrl.rewards.config import RewardsConfig, load_plugins
from hpcrl.rewards.verifiers import Outcome, Verdict, get_verifier


@dataclass(frozen=True)
class Task:
    index: int
    completion: str
    answer: str
    prompt: str
    verdict: tuple[str, float] | None = None
    """Graded already (outcome, reward: a multi-turn episode's environment, ``envs/episodes.py``): the
    pool records it as it is, without a verifier."""


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
            if not isinstance(verdict, Verdict):
                raise TypeError(
                    f"verifier {verifier_name!r} returned {type(verdict).__name__}, not a Verdict"
                )
        except Exception:  # a bad reward (outside [0, 1]) is raised by Verdict itself
            verdict = Verdict(Outcome.error)
        conn.send((task.index, verdict.outcome.value, verdict.reward))


READY = ("ready", None)


def _repeated(indices: list[int]) -> set[int]:
    return {x for x, n in Counter(indices).items() if n > 1}


@dataclass
class _Slot:
    proc: Any
    conn: Connection
    task: int | None = None
    started: float = 0.0
    ready: bool = False
    spawned: float = 0.0


class RewardPool:
    """``verifier`` in ``settings.process_count()`` processes, under the run's ``rewards.*`` limits.

    Streaming: ``submit(tasks)`` returns at once and the pool's thread hands the tasks to free
    processes while the caller does something else (waits for the rest of a batch to generate);
    ``drain()`` waits for everything submitted and returns the verdicts by task index. ``score`` is
    the two in one call. The thread is the only one that touches the processes; callers only touch
    the queue and the results, under ``_cond``.
    """

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
        self._cond = threading.Condition()
        self._queue: deque[Task] = deque()
        self._submitted: set[int] = set()  # indices submitted since the last drain
        self._results: dict[int, Verdict] = {}
        self._failure: BaseException | None = None
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="reward-pool", daemon=True)
        self._thread.start()

    def submit(self, tasks: list[Task]) -> None:
        """Queue ``tasks`` for scoring and return at once. Indices must be unique until drained."""
        with self._cond:
            self._raise_failure()
            indices = [t.index for t in tasks]
            clash = self._submitted.intersection(indices) | _repeated(indices)
            if clash:
                raise ValueError(f"task indices must be unique until drain(): {sorted(clash)[:5]} repeat")
            self._submitted.update(indices)
            for t in tasks:
                if t.verdict is None:
                    self._queue.append(t)
                else:
                    self._results[t.index] = Verdict(Outcome(t.verdict[0]), t.verdict[1])
            self._cond.notify_all()

    def drain(self) -> dict[int, Verdict]:
        """Wait until every task submitted since the last drain is scored; their verdicts by index."""
        with self._cond:
            while len(self._results) < len(self._submitted) and self._failure is None:
                self._cond.wait(timeout=1.0)
            self._raise_failure()
            results, self._results, self._submitted = self._results, {}, set()
        return results

    def score(self, tasks: list[Task]) -> list[Outcome]:
        """The outcomes of ``tasks``, in order (``submit`` + ``drain``; nothing else may be in flight)."""
        with self._cond:
            if self._submitted:
                raise RuntimeError("score() while submitted tasks are not drained; call drain() first")
        self.submit(tasks)
        verdicts = self.drain()
        return [verdicts[t.index].outcome for t in tasks]

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise RuntimeError(str(self._failure)) from self._failure

    def _run(self) -> None:
        """The pool's thread: hand out queued tasks, collect verdicts, enforce the time limits."""
        try:
            while True:
                with self._cond:
                    while not self._closing and not self._queue and self._idle():
                        self._cond.wait()
                    if self._closing:
                        return
                    self._dispatch()
                busy = [s.conn for s in self.slots if s.task is not None or not s.ready]
                readable = wait(busy, timeout=0.2)
                with self._cond:
                    self._collect(readable)
        except BaseException as exc:  # a process that never starts: the caller's next call raises it
            with self._cond:
                self._failure = exc
                self._cond.notify_all()

    def _idle(self) -> bool:
        return all(s.ready and s.task is None for s in self.slots)

    def _dispatch(self) -> None:
        for i, slot in enumerate(self.slots):
            if slot.ready and slot.task is None and self._queue:
                task = self._queue.popleft()
                try:
                    slot.conn.send(task)
                except OSError:  # the process died while idle (OOM killer): its replacement takes it
                    self._queue.appendleft(task)
                    self._replace(i)
                    continue
                slot.task, slot.started = task.index, time.monotonic()

    def _collect(self, readable: list[Any]) -> None:
        for i, slot in enumerate(self.slots):
            if not slot.ready:
                self._await_ready(i, slot, slot.conn in readable)
            elif slot.task is None:
                continue
            elif slot.conn in readable:
                try:
                    index, value, reward = slot.conn.recv()
                except (EOFError, OSError):  # the process died mid-task
                    self._finish(slot.task, Verdict(Outcome.error))
                    self._replace(i)
                    continue
                self._finish(index, Verdict(Outcome(value), reward))
                slot.task = None
            elif time.monotonic() - slot.started > self.timeout_s:
                self._finish(slot.task, Verdict(Outcome.timeout))
                self._replace(i)

    def _finish(self, index: int, verdict: Verdict) -> None:
        self._results[index] = verdict
        self._cond.notify_all()

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
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
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
