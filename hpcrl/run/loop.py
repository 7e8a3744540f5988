"""The GRPO/DAPO loop: prompts -> rollouts -> rewards -> advantages -> train step -> weight sync
-> validation / checkpoint / logs. GRPO and DAPO differ only in ``algo`` settings.

    for each step:
        sample prompts; generate n completions each on the rollout engines
        score them with the verifier (a pool of processes, hard time limit per sample)
        shape rewards (overlong penalty, scaling); DAPO: drop groups with equal rewards, sample more
        group-relative advantages; clipped-surrogate + KL loss on the trainer ranks, each on its shard
            (the reference log-probs computed there, the metrics reduced over the ranks)
        broadcast the new weights to the engines; validate, checkpoint and log when due

``train`` is that loop, ``one_step`` one pass of it, shared with the overlapped loop (run/overlap.py), which
differs only in where a step's batch comes from (``Batches``). The driver hands it one ``Run``: config, actors,
reward pool, tokenizer, prompts, checkpoints, logs (actors and pool as protocols: tests/run/test_loop.py).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import torch

from hpcrl.algo.advantages import group_advantages
from hpcrl.algo.schedule import lr_at
from hpcrl.algo.shaping import informative_groups, overlong_penalty, scale_rewards, truncation_mask
from hpcrl.config.schema import RunConfig
from hpcrl.data.loader import Example, PromptStream
from hpcrl.rewards.pool import Task
from hpcrl.rewards.verifiers import Outcome, Verdict, reward_of
from hpcrl.rollout.base import Completion, Prompt, SamplingSettings, completion_metrics
from hpcrl.run.checkpoint import CheckpointManager
from hpcrl.run.metrics import console_line, sample_rows
from hpcrl.run.preempt import REQUEST, WHY, Preempted
from hpcrl.run.timesplit import generate_seconds, own_stats
from hpcrl.run.vision import Encoded
from hpcrl.trainer.batch import TrainBatch, build_batch


@dataclass
class Timer:
    """Per-phase seconds of one step, from ``start``."""

    times: dict[str, float] = field(default_factory=dict)
    start: float = field(default_factory=time.perf_counter)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.times[f"time/{name}"] = self.times.get(f"time/{name}", 0.0) + time.perf_counter() - start


@dataclass
class Scored:
    examples: list[Example]
    groups: list[list[Completion]]
    rewards: torch.Tensor  # [groups, n], after shaping
    outcomes: list[list[Outcome]]

    def subset(self, idx: list[int]) -> Scored:
        return Scored(
            [self.examples[i] for i in idx],
            [self.groups[i] for i in idx],
            self.rewards[idx],
            [self.outcomes[i] for i in idx],
        )

    @staticmethod
    def concat(parts: list[Scored], limit: int) -> Scored:
        """The first ``limit`` groups of ``parts``, in order."""
        return Scored(
            [e for k in parts for e in k.examples][:limit],
            [g for k in parts for g in k.groups][:limit],
            torch.cat([k.rewards for k in parts])[:limit],
            [o for k in parts for o in k.outcomes][:limit],
        )


class Scorer(Protocol):
    """What the loop asks of the reward pool (``hpcrl.rewards.pool.RewardPool``): tasks go in as the
    engines finish them, verdicts (by task index) come out once the batch is in."""

    def submit(self, tasks: list[Task]) -> None: ...
    def drain(self) -> dict[int, Verdict]: ...


class Actors(Protocol):
    """What the loop asks of the actors (``run/fleet.py``'s Fleet on Ray; a fake in tests/run/test_loop.py)."""

    def generate_stream(
        self, prompts: list[Prompt], settings: SamplingSettings
    ) -> Iterator[list[tuple[int, list[Completion]]]]:
        """(prompt index, its group) pairs, handed over as the engines finish them."""
        ...

    def train_step(self, batch: TrainBatch, lr: float | None = None) -> dict[str, float]:
        """The trainer ranks' step, each on its shard, at ``lr``; the whole batch's metrics."""
        ...

    def sleep_engines(self) -> None: ...
    def sync_weights(self, version: int) -> dict[str, float]: ...
    def save_checkpoint(self, path: str, async_save: bool) -> float: ...
    def finish_checkpoint(self) -> float: ...


class Logger(Protocol):
    """Where each step's metrics go (``hpcrl.run.metrics.MetricsLogger``)."""

    def log(self, step: int, metrics: dict[str, float]) -> None: ...
    def samples(self, step: int, rows: list[dict[str, Any]]) -> None: ...


@dataclass(frozen=True)
class Run:
    """What one run's loop works with from the first step to the last; the driver builds it once.
    Per-step values (the step, its metrics) are parameters of the functions that take it."""

    cfg: RunConfig
    actors: Actors
    pool: Scorer
    encode: Callable[[Example], Encoded]
    """An example's prompt as the engines and the trainer take it (``run/vision.py``)."""
    pad_id: int
    stream: PromptStream
    """The training prompts, in the order a checkpoint restores."""
    val: list[Example]
    ckpt: CheckpointManager
    logger: Logger
    say: Callable[[str], None]
    """One console line."""


def generate_and_score(
    actors: Actors,
    pool: Scorer,
    encode: Callable[[Example], Encoded],
    examples: list[Example],
    settings: SamplingSettings,
) -> Scored:
    n = settings.n
    groups: list[list[Completion]] = [[] for _ in examples]
    for part in actors.generate_stream([encode(e).engine for e in examples], settings):
        tasks = []
        for i, group in part:
            groups[i], e = group, examples[i]
            tasks += [Task(i * n + j, c.text, e.answer, e.prompt, c.verdict) for j, c in enumerate(group)]
        pool.submit(tasks)  # scored while the engines finish the rest of the batch
    verdicts = pool.drain()
    rows = [[verdicts[i * n + j] for j in range(n)] for i in range(len(examples))]
    rewards = torch.tensor([[reward_of(v) for v in row] for row in rows], dtype=torch.float32)
    return Scored(examples, groups, rewards, [[v.outcome for v in row] for row in rows])


def shape(cfg: RunConfig, s: Scored) -> torch.Tensor:
    algo = cfg.algo
    rewards = s.rewards.clone()
    if algo.overlong_buffer:
        lengths = torch.tensor([[len(c.token_ids) for c in g] for g in s.groups])
        rewards += overlong_penalty(
            lengths, cfg.rollout.max_new_tokens, algo.overlong_buffer, algo.overlong_penalty
        )
    if algo.reward_scale_min is not None and algo.reward_scale_max is not None:
        rewards = scale_rewards(rewards, algo.reward_scale_min, algo.reward_scale_max)
    return rewards


def sampling(cfg: RunConfig, step: int, round_: int) -> SamplingSettings:
    """Training sampling settings; the seed differs per step and per dynamic-sampling round."""
    seed = cfg.run.seed * 100_003 + step * 101 + round_
    return SamplingSettings.of(cfg.rollout, cfg.algo.num_generations, seed)


def collect(run: Run, step: int) -> tuple[Scored, torch.Tensor, dict[str, float]]:
    """One step's rollouts; with dynamic sampling, keep sampling until the batch holds enough
    informative groups (or the rounds run out: then the batch is smaller)."""
    cfg, algo = run.cfg, run.cfg.algo
    want, _ = algo.num_prompts_per_step, own_stats(run)  # validation's judge and cache figures are its own
    kept: list[Scored] = []
    kept_rewards: list[torch.Tensor] = []
    seen: list[Scored] = []
    for round_ in range(algo.dynamic_sampling_max_rounds if algo.dynamic_sampling else 1):
        examples, settings = run.stream.take(want), sampling(cfg, step, round_)
        scored = generate_and_score(run.actors, run.pool, run.encode, examples, settings)
        seen.append(scored)
        rewards = shape(cfg, scored)
        keep = (
            informative_groups(rewards)
            if algo.dynamic_sampling
            else torch.ones(len(rewards), dtype=torch.bool)
        )
        idx = [i for i in range(len(rewards)) if keep[i]]
        kept.append(scored.subset(idx))
        kept_rewards.append(rewards[idx])
        if sum(len(k.examples) for k in kept) >= want:
            break
    merged = Scored.concat(kept, want)
    shaped = torch.cat(kept_rewards)[:want]
    return merged, shaped, rollout_stats(seen, len(merged.examples)) | own_stats(run)


def rollout_stats(seen: list[Scored], kept_groups: int) -> dict[str, float]:
    """Accuracy and length figures over every completion generated this step, filtered or not."""
    every = [o for s in seen for row in s.outcomes for o in row]
    completions = [c for s in seen for g in s.groups for c in g]
    n, m = max(1, len(every)), max(1, len(completions))
    return {
        "train/accuracy": sum(o is Outcome.correct for o in every) / n,
        "train/parse_error_rate": sum(o is Outcome.parse_error for o in every) / n,
        "train/verifier_timeouts": float(sum(o in (Outcome.timeout, Outcome.error) for o in every)),
        "train/mean_gen_tokens": sum(len(c.token_ids) for c in completions) / m,
        "train/truncated_rate": sum(c.truncated for c in completions) / m,
        "train/dynamic_sampling_rounds": float(len(seen)),
        "train/kept_groups": float(kept_groups),
        "perf/gen_tokens": float(sum(len(c.token_ids) for c in completions)),
    } | completion_metrics(completions)


def make_batch(run: Run, s: Scored, shaped: torch.Tensor) -> TrainBatch:
    algo, pad_id = run.cfg.algo, run.pad_id
    adv = group_advantages(shaped, algo.baseline, algo.std_normalize)
    prompts, comps, lps, advs, keep, images, routes = [], [], [], [], [], [], []
    for i, (e, g) in enumerate(zip(s.examples, s.groups, strict=True)):
        p = run.encode(e)
        for j, c in enumerate(g):
            prompts.append(p.ids)
            images.append(p.images)
            routes.append(c.routes)
            comps.append(c.token_ids or [pad_id])
            lps.append(c.logprobs if c.token_ids else [])  # []: none from the engine (NaN in the batch)
            advs.append(float(adv[i, j]))
            keep.append(float(truncation_mask(torch.tensor(c.truncated))) if algo.overlong_filter else 1.0)
    masks = [c.mask for g in s.groups for c in g]  # multi-turn: the model's tokens (envs/episodes.py)
    return build_batch(prompts, comps, lps, advs, keep, pad_id, images, routes, masks)


def validate(run: Run, step: int) -> dict[str, float]:
    """Greedy decoding, one sample per validation prompt; the first few logged as text."""
    cfg = run.cfg
    settings = SamplingSettings(1, 0.0, 1.0, cfg.rollout.max_new_tokens, seed=cfg.run.seed)
    scored = generate_and_score(run.actors, run.pool, run.encode, run.val, settings)
    run.logger.samples(step, sample_rows(scored, cfg.logger.val_samples))
    outcomes = [row[0] for row in scored.outcomes]
    return {
        "val/accuracy": sum(o is Outcome.correct for o in outcomes) / max(1, len(outcomes)),
        "val/parse_error_rate": sum(o is Outcome.parse_error for o in outcomes) / max(1, len(outcomes)),
        "val/mean_gen_tokens": sum(len(g[0].token_ids) for g in scored.groups) / max(1, len(scored.groups)),
    }


def train(run: Run, start_step: int = 0) -> dict[str, float]:
    """Steps ``start_step + 1 .. algo.max_steps``, on-policy (``algo.max_staleness`` > 0 runs
    ``run/overlap.py``'s loop instead); returns the last value of every metric."""
    algo = run.cfg.algo
    if algo.max_staleness:
        raise ValueError(
            "loop.train is the on-policy loop: algo.max_staleness > 0 is overlap.train_overlapped"
        )
    last = validate_first(run) if start_step == 0 else {}
    batches = OnPolicy(run)
    for step in range(start_step + 1, algo.max_steps + 1):
        metrics = one_step(run, step, batches)
        stop = save_when_due(run, step, metrics, partial(run_state, run.stream, step))
        last = {**last, **metrics}
        report(run, step, metrics, stop)
    return last


def validate_first(run: Run) -> dict[str, float]:
    """Validation before the first step (``algo.val_at_start``)."""
    if not run.cfg.algo.val_at_start:
        return {}
    metrics = validate(run, 0)
    run.logger.log(0, metrics)
    run.say(f"step   0/{run.cfg.algo.max_steps} | val {metrics['val/accuracy']:.3f} (before training)")
    return metrics


def validation_due(cfg: RunConfig, step: int) -> bool:
    return step % cfg.algo.val_period == 0 or step == cfg.algo.max_steps


def checkpoint_due(cfg: RunConfig, step: int) -> bool:
    return cfg.checkpoint.enabled and (step % cfg.checkpoint.period == 0 or step == cfg.algo.max_steps)


def save_when_due(
    run: Run, step: int, metrics: dict[str, float], state: Callable[[], dict[str, Any]]
) -> bool:
    """Commit the previous step's async save (written while this one ran), then save this step when
    due or when Slurm's warning signal came during it (``state``: the driver's part). Records
    ``time/checkpoint_blocked``; returns whether the run stops after this step."""
    cfg, ckpt, actors = run.cfg, run.ckpt, run.actors
    blocked = ckpt.settle(actors)
    # Read once: the save and the stop must agree (a signal landing between two reads would stop the
    # run without its checkpoint). A later signal is taken at the next step.
    stop = REQUEST.asked
    if checkpoint_due(cfg, step) or stop:  # a stop's save must finish before the run ends
        last_one = stop or step == cfg.algo.max_steps
        blocked += ckpt.save(step, actors, state(), metrics, cfg.checkpoint.async_save and not last_one)
    metrics.update({"time/checkpoint_blocked": blocked, "faults/save_failures": ckpt.failures})
    return stop


def report(run: Run, step: int, metrics: dict[str, float], stop: bool) -> None:
    """Log the step; on a stop, end the run here (the checkpoint is saved)."""
    run.logger.log(step, metrics)
    run.say(console_line(step, run.cfg.algo.max_steps, metrics))
    if stop:
        REQUEST.done(step)
        if step < run.cfg.algo.max_steps:
            run.say(f"stopping after step {step} on {WHY[REQUEST.signum]}: checkpoint saved")
            raise Preempted(step, REQUEST.signum)


@dataclass
class Rollouts:
    """One step's batch as the engines made it. Which policy made it is stamped on each completion
    (``Completion.versions``, by the engines): with ``rollout.inflight_update`` one batch can span
    several."""

    step: int
    """The step that trains on it."""
    scored: Scored
    """Prompts, completions (with their versions), raw rewards, outcomes."""
    shaped: torch.Tensor
    metrics: dict[str, float]
    seconds: float  # generation and scoring


class Batches(Protocol):
    """Where each step's batch comes from: generated when the step starts (``OnPolicy``), or ahead
    of it by older weights (run/overlap.py's ``Pipeline``)."""

    def take(self, step: int, timer: Timer) -> Rollouts:
        """Step ``step``'s batch; the wait for it is ``timer``'s "rollout" phase."""
        ...

    def before_refit(self, step: int, timer: Timer) -> None:
        """After training, before the weights change: generation under way finishes first (unless it may)."""
        ...


@dataclass(frozen=True)
class OnPolicy:
    """The on-policy loop's batches: generated by the weights about to be trained."""

    run: Run

    def take(self, step: int, timer: Timer) -> Rollouts:
        with timer("rollout"):
            scored, shaped, metrics = collect(self.run, step)
        self.run.actors.sleep_engines()  # rollout.sleep: colocated engines free their GPU memory for training
        return Rollouts(step, scored, shaped, metrics, timer.times["time/rollout"])

    def before_refit(self, step: int, timer: Timer) -> None:
        """Nothing generates while the trainers train."""


def one_step(run: Run, step: int, batches: Batches) -> dict[str, float]:
    """The batch, the train step (the trainer ranks score their shards under the reference policy
    for the KL term and reduce the metrics over themselves), the weight sync, and the validation
    when due; returns the step's metrics with per-phase times."""
    actors = run.actors
    timer = Timer()
    got = batches.take(step, timer)
    metrics = dict(got.metrics)
    metrics["time/generate"] = generate_seconds(got.seconds, metrics)  # the time split: run/timesplit.py
    batch = make_batch(run, got.scored, got.shaped)
    with timer("train"):  # the trainers' reference pass within it: time/ref_logprobs
        trained = actors.train_step(batch, lr_at(run.cfg.algo, step))
    metrics.update({k if k.startswith("time/") else f"train/{k}": v for k, v in trained.items()})
    metrics["train/lr"] = lr_at(run.cfg.algo, step)
    batches.before_refit(step, timer)
    with timer("weight_sync"):
        # asleep: wakes the engines' weights, refits, wakes their KV cache; the refit's phases, faults/*
        metrics.update({k if "/" in k else f"refit/{k}": v for k, v in actors.sync_weights(step).items()})
    metrics["train/reward"] = float(got.shaped.mean())
    if validation_due(run.cfg, step):
        with timer("validation"):
            metrics.update(validate(run, step))
    metrics.update(timer.times)
    metrics["time/step"] = time.perf_counter() - timer.start
    metrics["perf/gen_tokens_per_s"] = metrics["perf/gen_tokens"] / max(got.seconds, 1e-9)
    return metrics


def run_state(stream: PromptStream, step: int) -> dict[str, Any]:
    """The driver's part of a checkpoint (the trainer ranks write theirs): the prompt stream's
    position, the step, the RNGs."""
    return {
        "stream": stream.state(),
        "step": step,
        "rng": {"python": random.getstate(), "torch": torch.get_rng_state()},
    }
