"""Rollout and training overlap: ``algo.max_staleness`` = N >= 1 (0 is ``loop.train``'s on-policy loop).

Fixed-lag pipelining, veRL's one-step-off generalised to N: the batch trained at step j is generated
by the policy of step max(0, j - 1 - N), so once the pipeline is full every sample is exactly N
policy versions old, never more. A fixed lag keeps a run reproducible for a fixed seed (which weights
generate which batch does not depend on timing) and lets it resume exactly. While the trainers run
step s, the engines generate batch s + N; after step s:

    wait for batch s + N              (generated while step s trained)
    weights of step s -> engines      (the engines are idle: no update lands inside a batch)
    validate / checkpoint when due    (the checkpoint holds batches s+1 .. s+N: samples of older
                                       policies that no checkpointed weights could regenerate)
    start batch s + N + 1 (policy s)  in the background, then train step s + 1 on batch s + 1

The trainer scores the batch under its current policy (the "old" log-probs of the PPO ratio) and the
importance correction (``algo.is_correction``) weighs that against the engine's log-probs, the
behaviour policy: decoupled PPO as AReaL writes it. Each sample carries the version that generated it;
``async/staleness`` and ``async/version_span`` are logged, ``train/gen_kl_error`` is the mismatch.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from hpcrl.rollout.backends import inflight_updates
from hpcrl.rollout.base import Completion
from hpcrl.run import loop
from hpcrl.run.engine_faults import EngineFailed
from hpcrl.run.loop import Rollouts  # here too: checkpoints written before it moved to loop.py name it here


class Pipeline:
    """Batches in flight or waiting, by step: ``loop.one_step``'s batches in the overlapped loop. One
    producer thread: the engines take one batch at a time, and the reward pool serves one caller at
    a time."""

    def __init__(self, run: loop.Run) -> None:
        self.run = run
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="hpcrl-rollout")
        self.batches: dict[int, Future[Rollouts]] = {}
        self.begun: dict[int, dict[str, int]] = {}
        """The prompt stream's position as each batch began taking its prompts (by step)."""

    def start(self, step: int) -> None:
        self.batches[step] = self.pool.submit(self._make, step)

    def _make(self, step: int) -> Rollouts:
        self.begun[step] = self.run.stream.state()  # one producer: the batches take prompts in step order
        t0 = time.perf_counter()
        scored, shaped, metrics = loop.collect(self.run, step)  # the engines stamp each completion's versions
        return Rollouts(step, scored, shaped, metrics, time.perf_counter() - t0)

    def restore(self, saved: list[Rollouts]) -> None:
        for r in saved:
            done: Future[Rollouts] = Future()
            done.set_result(r)
            self.batches[r.step] = done

    def last_step(self, default: int) -> int:
        return max(self.batches, default=default)

    def take(self, step: int, timer: loop.Timer) -> Rollouts:
        """Batch ``step``, with how stale it is and how long it took to make (in the background)."""
        with timer("rollout"):  # the part of generation the trainers wait for
            got = self.batches[step].result()
        del self.batches[step]  # only once made: a batch whose engines failed stays, for ``buffered``
        more = {**staleness_metrics(got.scored.groups, step - 1), "time/generate": got.seconds}
        return dataclasses.replace(got, metrics={**got.metrics, **more})

    def before_refit(self, step: int, timer: loop.Timer) -> None:
        """The engines finish the batch in flight before the weights change, unless they may change
        under it (``rollout.inflight_update``) and this step does not validate or save, which need
        the engines idle and the batch whole."""
        cfg = self.run.cfg
        if inflight_updates(cfg.rollout) and not (
            loop.validation_due(cfg, step) or loop.checkpoint_due(cfg, step)
        ):
            return
        with timer("rollout_after_train"):  # generation outlasting the train step: the engines are the limit
            self.settle()

    def settle(self) -> list[Rollouts]:
        """Wait for every batch started; all of them, in step order (what a checkpoint keeps)."""
        return [self.batches[s].result() for s in sorted(self.batches)]

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def buffered(self) -> Buffered:
        """After ``close``: what a stop at ``rollout.max_engine_restarts`` keeps (the batches not yet
        trained that are complete, in step order up to the first that is not: a resume fills the
        pipeline from the last one kept), and the stream's position before the first one begun and
        not kept took its prompts."""
        kept: list[Rollouts] = []
        for s in sorted(self.batches):
            made = self.batches[s]
            if made.cancelled() or made.exception() is not None:
                break
            kept.append(made.result())
        after = kept[-1].step if kept else min(self.batches, default=0) - 1
        dropped = [s for s in sorted(self.batches) if s > after and s in self.begun]
        return Buffered(kept, self.begun[dropped[0]] if dropped else None, dropped)


@dataclass(frozen=True)
class Buffered:
    """The generated batches a stop at ``rollout.max_engine_restarts`` saves (``engine_faults.save_and_stop``)."""

    rollouts: list[Rollouts]
    """Complete: trained on after the resume, at the version that made them, as after a preemption."""
    stream: dict[str, int] | None
    """The prompt stream's position before the first dropped batch took its prompts: the resume makes
    it again from them. None: none was dropped (the stream's position now)."""
    dropped: list[int]
    """The steps whose batch was begun and is not kept: the first one the failing engines left
    incomplete, any after it (begun later) with it, as the resume's pipeline has no gaps."""

    def said(self) -> str:
        """The stop line's part: which batches the checkpoint keeps, which were dropped."""
        out = f" with the {_batches([r.step for r in self.rollouts])} generated" if self.rollouts else ""
        if self.dropped:  # the first is the one the engines failed in; any after it began later
            first, *after = self.dropped
            also = f", and the {_batches(after)} after it," if after else ","
            again = "them" if after else "it"
            out += (
                f" (the batch for step {first}, left incomplete by the failing engines{also} dropped: the "
                f"resume makes {again} again)"
            )
        return out


def _batches(steps: list[int]) -> str:
    """``batch for step 7``, ``batches for steps 7, 8``: the stop line's words."""
    many = len(steps) > 1
    return f"batch{'es' if many else ''} for step{'s' if many else ''} {', '.join(map(str, steps))}"


def staleness_metrics(groups: list[list[Completion]], trainer_version: int) -> dict[str, float]:
    """How far behind the trainer the batch's samples are, in optimizer steps (the oldest token's
    policy), and how many versions the batch spans: 0 unless weights changed under it
    (``rollout.inflight_update``)."""
    first = [c.versions[0] for g in groups for c in g]
    latest = [c.versions[1] for g in groups for c in g]
    if not first:
        return {}
    return {
        "async/staleness": float(trainer_version - min(first)),
        "async/staleness_mean": float(trainer_version - sum(first) / len(first)),
        "async/version_span": float(max(latest) - min(first)),
    }


def resumable(rollouts: list[Rollouts], step: int, lag: int) -> list[Rollouts]:
    """The batches a checkpoint taken after ``step`` kept that a run with ``algo.max_staleness=lag``
    may still train on: due within ``lag`` steps, and made by a policy at most ``lag`` versions older
    than the one that trains on them (a run resumed with a lower lag than it saved with)."""

    def stale(r: Rollouts) -> int:  # its oldest token's versions behind the policy that trains on it
        trainer = r.step - 1
        return trainer - min((c.versions[0] for g in r.scored.groups for c in g), default=trainer)

    return [r for r in rollouts if r.step <= step + lag and stale(r) <= lag]


def train_overlapped(
    run: loop.Run, start_step: int = 0, restored: list[Rollouts] | None = None
) -> dict[str, float]:
    """``loop.train`` with generation one (or N) steps ahead of training; same arguments, plus the
    batches a checkpoint restored."""
    algo, lag = run.cfg.algo, run.cfg.algo.max_staleness
    last = loop.validate_first(run) if start_step == 0 else {}
    pipe = Pipeline(run)
    pipe.restore(restored or [])
    try:
        # fill the pipeline: every batch up to start + 1 + N comes from the weights the engines hold now
        for j in range(pipe.last_step(start_step) + 1, min(start_step + 1 + lag, algo.max_steps) + 1):
            pipe.start(j)
        for step in range(start_step + 1, algo.max_steps + 1):
            metrics = loop.one_step(run, step, pipe)

            def state(s: int = step) -> dict[str, Any]:  # with the batches older policies made
                return {**loop.run_state(run.stream, s), "rollouts": pipe.settle()}

            stop = loop.save_when_due(run, step, metrics, state)
            if not stop and step + 1 + lag <= algo.max_steps:
                pipe.start(step + 1 + lag)  # this step's weights; after the save: its prompts are not in it
            last = {**last, **metrics}
            loop.report(run, step, metrics, stop)
    except EngineFailed as failed:  # past rollout.max_engine_restarts: the driver saves and stops
        pipe.close()  # the batch being made ends first: complete, or failed with the engines
        failed.buffered = pipe.buffered()
        raise
    finally:
        pipe.close()
    return last
