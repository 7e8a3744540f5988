"""A rollout engine that dies or hangs mid-step costs its unfinished groups, never the run.

An engine's stream of finished groups ends in an error when its actor dies (process killed, node
lost: Ray's ``ActorDiedError``) or its call raises (a CUDA error); it is taken as hung when it has
work and hands over no group for ``rollout.hang_timeout_s`` (then it is killed). Either way the
prompts it had not finished go to the engines that are idle (the others, once their share is done),
and the engine is rebuilt in its slot and refit with the trainers' weights before the next step
(``Fleet.sync_weights``); only when no engine is left do they come back at once, so the batch can
finish. A group is handed over whole, so nothing of a dead engine's half-finished groups is kept:
every sample comes from one engine holding one weights version, which it stamps.

Past ``rollout.max_engine_restarts`` restarts in a run, ``EngineFailed`` ends it: the driver saves
what the trainers hold and stops with one line naming the engine's node and the cause.

``dispatch`` is the scheduling without Ray (tests/run/test_engine_faults.py drives it with threads);
``Fleet`` (run/fleet.py) gives it Ray streams, the kill and the rebuild.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from hpcrl.errors import HpcrlError
from hpcrl.rollout.base import Completion

Parts = Iterator[list[tuple[int, list[Completion]]]]
"""(prompt index, its group) pairs as an engine finishes them."""

POLL_S = 1.0
"""How often a wait for groups looks for a hung engine."""


class EngineFailed(HpcrlError):
    """Rollout engines failed more often than ``rollout.max_engine_restarts`` allows."""

    buffered: Any = None
    """``algo.max_staleness`` > 0: the generated batches the stop's save keeps (run/overlap.py's
    ``Buffered``, set as the overlapped loop ends); None: the on-policy loop holds none."""


@dataclass
class EngineFaults:
    """The run's engine faults: the bound, which engines are down and why, the counts not yet logged."""

    max_restarts: int
    hang_timeout_s: float
    down: dict[int, str] = field(default_factory=dict)
    """Engines lost and not yet rebuilt, with the cause."""
    restarts: int = 0
    """In this run (the bound counts these)."""
    unlogged: dict[str, float] = field(default_factory=lambda: {"restarts": 0.0, "lost": 0.0})
    lock: threading.Lock = field(default_factory=threading.Lock)

    def lost(self, engine: int, host: str, cause: str, groups: int) -> None:
        """Engine ``engine`` (on ``host``) is gone with ``groups`` unfinished; raises ``EngineFailed``
        past the bound."""
        with self.lock:
            self.restarts += 1
            self.down[engine] = cause
            self.unlogged["restarts"] += 1
            self.unlogged["lost"] += groups
        if self.restarts > self.max_restarts:
            raise EngineFailed(
                f"rollout engine {engine} on {host} failed ({cause}): {self.restarts} engine failures in "
                f"this run, more than rollout.max_engine_restarts={self.max_restarts}"
            )

    def metrics(self) -> dict[str, float]:
        """``faults/engine_restarts`` and ``faults/lost_groups`` since the last call."""
        with self.lock:
            out = {
                "faults/engine_restarts": self.unlogged["restarts"],
                "faults/lost_groups": self.unlogged["lost"],
            }
            self.unlogged = {"restarts": 0.0, "lost": 0.0}
        return out


def cause_of(exc: BaseException) -> str:
    """One line: the exception's type and its last line (Ray wraps an actor's traceback in the
    message), cut after a sentence near 200 characters (Ray's own go on with advice)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    last = lines[-1]
    if len(last) > 200:
        cut = last.rfind(". ", 0, 200)
        last = last[: cut + 1] if cut > 0 else last[:200] + "..."
    return f"{type(exc).__name__}: {last}"


@dataclass
class _Share:
    """One engine's call: which prompts (global indices), which it has handed over, when it last did."""

    engine: int
    prompts: list[int]
    done: set[int] = field(default_factory=set)
    last: float = field(default_factory=time.monotonic)


_END = object()


def dispatch(
    n_prompts: int,
    live: list[int],
    start: Callable[[int, list[int], int], Iterable[list[tuple[int, list[Completion]]]]],
    kill: Callable[[int], str],
    revive: Callable[[], list[int]],
    faults: EngineFaults,
) -> Parts:
    """Prompts ``0 .. n_prompts - 1`` over the ``live`` engines (the i-th takes prompts i::k, as
    without faults), groups (global indices) as they finish. ``start(engine, prompts, call)``: that
    engine's stream over ``prompts`` (local indices; ``call`` numbers the calls of this batch, for
    its seed); ``kill(engine)``: end a hung or failed engine, its host; ``revive()``: bring the lost
    engines back now (none is left), their indices."""
    d = _Dispatch(start, kill, faults, idle=list(live))
    d.spread(list(range(n_prompts)))
    while d.running or d.orphans:
        if d.orphans and not d.running and not d.idle:
            d.idle.extend(revive())
        if d.orphans and d.idle:
            taken, d.orphans = sorted(d.orphans), []
            d.spread(taken)
        try:
            share, part = d.parts.get(timeout=POLL_S)
        except queue.Empty:
            d.lose_hung()
            continue
        if d.running.get(share.engine) is not share:
            continue  # a lost engine's stream, ending after it was given up
        if part is _END:
            d.running.pop(share.engine)
            d.idle.append(share.engine)
        elif isinstance(part, BaseException):
            d.lose(share, cause_of(part))
        else:
            share.last = time.monotonic()
            handed = [(share.prompts[j], group) for j, group in part]
            share.done.update(i for i, _ in handed)
            yield handed


@dataclass
class _Dispatch:
    """``dispatch``'s state: the engines running a share, the idle ones, the prompts orphaned by a
    lost engine, and the queue the engines' threads hand their groups to."""

    start: Callable[[int, list[int], int], Iterable[list[tuple[int, list[Completion]]]]]
    kill: Callable[[int], str]
    faults: EngineFaults
    idle: list[int]
    running: dict[int, _Share] = field(default_factory=dict)
    orphans: list[int] = field(default_factory=list)
    parts: queue.Queue[tuple[_Share, Any]] = field(default_factory=queue.Queue)
    calls: int = 0

    def spread(self, prompts: list[int]) -> None:
        """``prompts`` over the idle engines, i::k."""
        engines, self.idle = self.idle, []
        for i, e in enumerate(engines):
            if prompts[i :: len(engines)]:
                self.launch(e, prompts[i :: len(engines)])
            else:
                self.idle.append(e)

    def launch(self, engine: int, prompts: list[int]) -> None:
        share = _Share(engine, prompts)
        self.running[engine], call = share, self.calls
        self.calls += 1

        def pump() -> None:
            try:
                for part in self.start(engine, prompts, call):
                    self.parts.put((share, part))
                self.parts.put((share, _END))
            except BaseException as exc:  # handled in the caller's thread
                self.parts.put((share, exc))

        threading.Thread(target=pump, daemon=True, name=f"hpcrl-engine-{engine}").start()

    def lose(self, share: _Share, cause: str) -> None:
        """The engine is gone (killed here): its unfinished prompts wait for an idle engine."""
        self.running.pop(share.engine)
        host = self.kill(share.engine)
        unfinished = [p for p in share.prompts if p not in share.done]
        self.orphans.extend(unfinished)
        self.faults.lost(share.engine, host, cause, len(unfinished))

    def lose_hung(self) -> None:
        limit = self.faults.hang_timeout_s
        for share in [s for s in self.running.values() if time.monotonic() - s.last > limit]:
            self.lose(share, f"no group finished for rollout.hang_timeout_s={limit:g} s")


def save_and_stop(run: Any, version: int, failed: EngineFailed) -> EngineFailed:
    """Past the bound: checkpoint what the trainers hold (policy ``version``, unless a checkpoint of
    it is there already), with the complete batches generated for the next steps (``failed.buffered``,
    as a preemption's save keeps them), and the error to stop with, in one line. ``run``: the loop's
    ``Run``."""
    from hpcrl.run.loop import run_state

    ckpt, latest = run.ckpt, run.ckpt.latest()
    if not run.cfg.checkpoint.enabled or version == 0:
        return EngineFailed(f"{failed}: stopped (no checkpoint: nothing to save)")
    if latest is not None and latest.step >= version:
        ckpt.settle(run.actors)  # that checkpoint kept its own batches when it was saved
        return EngineFailed(f"{failed}: stopped after saving step {version}; submit again to resume")
    state, kept = run_state(run.stream, version), ""
    if (buffered := failed.buffered) is not None:
        state["rollouts"] = buffered.rollouts
        if buffered.stream is not None:  # a dropped batch's prompts: the resume takes them again
            state["stream"] = buffered.stream
        kept = buffered.said()
    ckpt.save(version, run.actors, state, {}, async_save=False)
    return EngineFailed(f"{failed}: stopped after saving step {version}{kept}; submit again to resume")
