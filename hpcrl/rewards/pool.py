"""Reward pool: verifiers run in separate processes with a hard per-sample time limit.

An adversarial completion that makes SymPy spin, or a verifier that crashes its process, costs
that one sample (scored as timeout/error, counted apart) and a process restart, never the run.
Each process has its own pipe and gets one task at a time, so the parent always knows which task
a process holds and since when: a killed or dead process can never lose a task silently.
A thread of the parent runs the processes, so tasks are scored while the caller waits on something
else (``submit`` now, ``drain`` later): a step's completions are scored as they are generated.
A verifier that raises or allocates past its memory limit fails that sample the same way. The first
failure is said once with its reason; a batch in which every sample failed is a broken verifier, not
bad answers, and stops the run (``HpcrlError``). How many processes, the time and memory limits and
the start-up deadline: ``rewards.*`` (``rewards/config.py``).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from hpcrl.errors import HpcrlError
from hpcrl.rewards.config import RewardsConfig, load_plugins
from hpcrl.rewards.verifiers import Outcome, Verdict, get_verifier, read_percent


@dataclass(frozen=True)
class Task:
    index: int
    completion: str
    answer: str
    prompt: str
    verdict: tuple[str, float] | None = None
    """Graded already (outcome, reward: a multi-turn episode's environment, ``envs/episodes.py``): the
    pool records it as it is, without a verifier."""


def _serve(
    verifier_name: str, plugins: str, percent: str | None, memory_mb: int | None, conn: Connection
) -> None:
    """One reward process: warm up, say READY, then score one task at a time until told to stop."""
    import logging

    logging.disable(logging.WARNING)  # math-verify warns on every call that its own timeouts are off
    _contain(memory_mb)
    try:
        load_plugins(plugins)
        verify = read_percent(get_verifier(verifier_name), percent)
    except BaseException as exc:  # the parent says it in one line, and stops
        conn.send((FAILED, one_line(exc, memory_mb)))
        return
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
        error = ""
        try:
            verdict = verify(task.completion, task.answer, task.prompt)
            if not isinstance(verdict, Verdict):
                raise TypeError(
                    f"verifier {verifier_name!r} returned {type(verdict).__name__}, not a Verdict"
                )
        except Exception as exc:  # a bad reward (outside [0, 1]) is raised by Verdict itself
            verdict, error = Verdict(Outcome.error), one_line(exc, memory_mb)
        conn.send((task.index, verdict.outcome.value, verdict.reward, error))


def _contain(memory_mb: int | None) -> None:
    """Signals and limits of a reward process, before any plugin code runs."""
    import signal

    # Slurm's warning (USR2), scancel's SIGTERM and a terminal's Ctrl-C (SIGINT, to the whole
    # foreground group) reach the reward processes too; the driver handles them (saves, then closes
    # the pool), and a reward process they killed would score its sample as an error.
    for sig in (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    with contextlib.suppress(OSError, AttributeError):  # Linux: die with the parent, hung or not
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"  # a plugin importing numpy reserves no thread buffers per CPU
    if memory_mb is not None:  # a verifier allocating past it gets a MemoryError: that sample's error
        import resource

        limit = memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def one_line(exc: BaseException, memory_mb: int | None = None) -> str:
    """An exception as one line of a message: its type and the first line of its text."""
    text = (str(exc).strip().splitlines() or [""])[0][:200]
    line = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    if isinstance(exc, MemoryError) and memory_mb is not None:
        line += f" (over rewards.memory_mb={memory_mb})"
    return line


def _warn(line: str) -> None:
    print(f"hpcrl: warning: {line}", file=sys.stderr, flush=True)


READY = ("ready", None)
FAILED = "failed"
"""What a reward process sends instead of READY when its verifier cannot start, with the reason."""


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

    def __init__(
        self,
        verifier: str,
        settings: RewardsConfig,
        percent: str | None = None,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        self.plugins = os.environ.get("HPCRL_PLUGINS", "")
        try:  # fail here, in the caller, on a module that does not import or an unknown name
            load_plugins(self.plugins)
            get_verifier(verifier)
        except Exception as exc:
            raise HpcrlError(
                f"verifier {verifier!r} cannot start: {one_line(exc)} "
                f"(HPCRL_PLUGINS={self.plugins or 'unset'})"
            ) from None
        self.verifier, self.settings, self.percent = verifier, settings, percent
        self.timeout_s, self.start_timeout_s = settings.timeout_s, settings.start_timeout_s
        self.warn = warn or _warn
        self.warned = False
        """Whether the first failing sample was reported (once per pool: later ones are counted only)."""
        self._errors: dict[int, str] = {}  # why each failed sample since the last drain failed
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
            errors, self._errors = self._errors, {}
        self._judge(results, errors)
        return results

    def _judge(self, results: dict[int, Verdict], errors: dict[int, str]) -> None:
        """A failing verifier is said at once; a batch where every sample failed stops the run."""
        if not errors:
            return
        first = errors[min(errors)]
        if len(errors) == len(results):
            raise HpcrlError(
                f"verifier {self.verifier!r} failed on all {len(results)} samples of a batch, the first "
                f"with {first}; fix the verifier (or its limits: rewards.timeout_s, rewards.memory_mb)"
            )
        if not self.warned:
            self.warned = True
            self.warn(
                f"verifier {self.verifier!r} failed on {len(errors)} of {len(results)} samples, the first "
                f"with {first}; each scores 0, counted in train/verifier_timeouts (said once)"
            )

    def score(self, tasks: list[Task]) -> list[Outcome]:
        """The outcomes of ``tasks``, in order (``submit`` + ``drain``; nothing else may be in flight)."""
        with self._cond:
            if self._submitted:
                raise RuntimeError("score() while submitted tasks are not drained; call drain() first")
        self.submit(tasks)
        verdicts = self.drain()
        return [verdicts[t.index].outcome for t in tasks]

    def _raise_failure(self) -> None:
        if isinstance(self._failure, HpcrlError):
            raise self._failure
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
                    index, value, reward, error = slot.conn.recv()
                except (EOFError, OSError):  # the process died mid-task
                    slot.proc.join(timeout=1)
                    self._finish(slot.task, Verdict(Outcome.error), f"exit code {slot.proc.exitcode}")
                    self._replace(i)
                    continue
                self._finish(index, Verdict(Outcome(value), reward), error)
                slot.task = None
            elif time.monotonic() - slot.started > self.timeout_s:
                error = f"no verdict within rewards.timeout_s={self.timeout_s:g}"
                self._finish(slot.task, Verdict(Outcome.timeout), error)
                self._replace(i)

    def _finish(self, index: int, verdict: Verdict, error: str = "") -> None:
        self._results[index] = verdict
        if error:
            self._errors[index] = error
        self._cond.notify_all()

    def _spawn(self) -> _Slot:
        parent, child = self.ctx.Pipe()
        args = (self.verifier, self.plugins, self.percent, self.settings.memory_mb, child)
        proc = self.ctx.Process(target=_serve, args=args, daemon=True)
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
                said = slot.conn.recv()
            except (EOFError, OSError):
                self._replace(i)
                return
            if said[0] == FAILED:
                raise HpcrlError(
                    f"reward process for verifier {self.verifier!r} cannot start: {said[1]} "
                    f"(plugins: {self.plugins or 'none'})"
                )
            slot.ready = said == READY
        elif time.monotonic() - slot.spawned > self.start_timeout_s:
            raise HpcrlError(
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
