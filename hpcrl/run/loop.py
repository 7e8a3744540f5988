"""The GRPO/DAPO loop: prompts -> rollouts -> rewards -> advantages -> train step -> weight sync
-> validation / checkpoint / logs. GRPO and DAPO differ only in ``algo`` settings.

    for each step:
        sample prompts; generate n completions each on the rollout engines
        score them with the verifier (a pool of processes, hard time limit per sample)
        shape rewards (overlong penalty, scaling); DAPO: drop groups with equal rewards, sample more
        group-relative advantages; clipped-surrogate + KL loss on the trainer ranks
        broadcast the new weights to the engines; validate, checkpoint and log when due

``train`` is that loop and ``one_step`` one pass of it; the loop sees the run's actors and the reward
pool only through the ``Actors`` and ``Scorer`` protocols, so tests/test_loop.py drives it with
recording fakes in milliseconds.
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
from hpcrl.algo.shaping import informative_groups, overlong_penalty, scale_rewards, truncation_mask
from hpcrl.config.schema import RunConfig
from hpcrl.data.loader import Example, PromptStream
from hpcrl.rewards.pool import Task
from hpcrl.rewards.verifiers import Outcome, Verdict, reward_of
from hpcrl.rollout.base import Completion, SamplingSettings
from hpcrl.run.metrics import console_line
from hpcrl.run.preempt import REQUEST, Preempted
from hpcrl.trainer.batch import TrainBatch, build_batch


@dataclass
class Timer:
    times: dict[str, float] = field(default_factory=dict)

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
    """What the loop asks of the run's actors (``hpcrl.run.fleet.Fleet`` on Ray; a recording fake in
    tests/test_loop.py)."""

    def generate_stream(
        self, prompts: list[list[int]], settings: SamplingSettings
    ) -> Iterator[list[tuple[int, list[Completion]]]]:
        """(prompt index, its group) pairs, handed over as the engines finish them."""
        ...

    def ref_logprobs(self, batch: TrainBatch) -> Any: ...
    def train_step(self, batch: TrainBatch, ref: Any) -> dict[str, float]: ...
    def sleep_engines(self) -> None: ...
    def sync_weights(self, version: int) -> dict[str, float]: ...
    def save_checkpoint(self, path: str, async_save: bool) -> float: ...
    def finish_checkpoint(self) -> float: ...


def generate_and_score(
    actors: Actors,
    pool: Scorer,
    encode: Callable[[str], list[int]],
    examples: list[Example],
    settings: SamplingSettings,
) -> Scored:
    n = settings.n
    groups: list[list[Completion]] = [[] for _ in examples]
    for part in actors.generate_stream([encode(e.prompt) for e in examples], settings):
        tasks = []
        for i, group in part:
            groups[i], e = group, examples[i]
            tasks += [Task(i * n + j, c.text, e.answer, e.prompt) for j, c in enumerate(group)]
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
    r = cfg.rollout
    seed = cfg.run.seed * 100_003 + step * 101 + round_
    return SamplingSettings(cfg.algo.num_generations, r.temperature, r.top_p, r.max_new_tokens, seed=seed)


def collect(
    cfg: RunConfig,
    actors: Actors,
    pool: Scorer,
    encode: Callable[[str], list[int]],
    stream: PromptStream,
    step: int,
) -> tuple[Scored, torch.Tensor, dict[str, float]]:
    """One step's rollouts; with dynamic sampling, keep sampling until the batch holds enough
    informative groups (or the rounds run out: then the batch is smaller)."""
    algo = cfg.algo
    want = algo.num_prompts_per_step
    kept: list[Scored] = []
    kept_rewards: list[torch.Tensor] = []
    seen: list[Scored] = []
    for round_ in range(algo.dynamic_sampling_max_rounds if algo.dynamic_sampling else 1):
        scored = generate_and_score(actors, pool, encode, stream.take(want), sampling(cfg, step, round_))
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
    return merged, shaped, rollout_stats(seen, len(merged.examples))


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
    }


def make_batch(
    cfg: RunConfig, s: Scored, shaped: torch.Tensor, encode: Callable[[str], list[int]], pad_id: int
) -> TrainBatch:
    algo = cfg.algo
    adv = group_advantages(shaped, algo.baseline, algo.std_normalize)
    prompts, comps, lps, advs, keep = [], [], [], [], []
    for i, (e, g) in enumerate(zip(s.examples, s.groups, strict=True)):
        p = encode(e.prompt)
        for j, c in enumerate(g):
            prompts.append(p)
            comps.append(c.token_ids or [pad_id])
            lps.append(c.logprobs or [0.0])  # rollout.logprobs=false: a placeholder the step never reads
            advs.append(float(adv[i, j]))
            keep.append(
                float(truncation_mask(torch.tensor([c.truncated]))[0]) if algo.overlong_filter else 1.0
            )
    return build_batch(prompts, comps, lps, advs, keep, pad_id)


def validate(
    cfg: RunConfig, actors: Actors, pool: Scorer, encode: Callable[[str], list[int]], val: list[Example]
) -> dict[str, float]:
    """Greedy decoding, one sample per validation prompt."""
    settings = SamplingSettings(1, 0.0, 1.0, cfg.rollout.max_new_tokens, seed=cfg.run.seed)
    scored = generate_and_score(actors, pool, encode, val, settings)
    outcomes = [row[0] for row in scored.outcomes]
    return {
        "val/accuracy": sum(o is Outcome.correct for o in outcomes) / max(1, len(outcomes)),
        "val/parse_error_rate": sum(o is Outcome.parse_error for o in outcomes) / max(1, len(outcomes)),
        "val/mean_gen_tokens": sum(len(g[0].token_ids) for g in scored.groups) / max(1, len(scored.groups)),
    }


def train(
    cfg: RunConfig,
    actors: Actors,
    pool: Scorer,
    encode: Callable[[str], list[int]],
    pad_id: int,
    stream: PromptStream,
    val: list[Example],
    ckpt: Any,
    logger: Any,
    say: Callable[[str], None],
    start_step: int = 0,
) -> dict[str, float]:
    """Steps ``start_step + 1 .. algo.max_steps``, on-policy (``algo.max_staleness`` > 0 runs
    ``run/overlap.py``'s loop instead); returns the last value of every metric."""
    algo = cfg.algo
    if algo.max_staleness:
        raise ValueError(
            "loop.train is the on-policy loop: algo.max_staleness > 0 is overlap.train_overlapped"
        )
    last = validate_first(cfg, actors, pool, encode, val, logger, say) if start_step == 0 else {}
    for step in range(start_step + 1, algo.max_steps + 1):
        metrics = one_step(cfg, actors, pool, encode, pad_id, stream, val, step)
        stop = save_when_due(cfg, ckpt, actors, step, metrics, partial(run_state, stream, step))
        last = {**last, **metrics}
        report(cfg, step, metrics, stop, logger, say)
    return last


def validate_first(
    cfg: RunConfig,
    actors: Actors,
    pool: Scorer,
    encode: Callable[[str], list[int]],
    val: list[Example],
    logger: Any,
    say: Callable[[str], None],
) -> dict[str, float]:
    """Validation before the first step (``algo.val_at_start``)."""
    if not cfg.algo.val_at_start:
        return {}
    metrics = validate(cfg, actors, pool, encode, val)
    logger.log(0, metrics)
    say(f"step   0/{cfg.algo.max_steps} | val {metrics['val/accuracy']:.3f} (before training)")
    return metrics


def checkpoint_due(cfg: RunConfig, step: int) -> bool:
    return cfg.checkpoint.enabled and (step % cfg.checkpoint.period == 0 or step == cfg.algo.max_steps)


def save_when_due(
    cfg: RunConfig,
    ckpt: Any,
    actors: Actors,
    step: int,
    metrics: dict[str, float],
    state: Callable[[], dict[str, Any]],
) -> bool:
    """Commit the previous step's async save (written while this one ran), then save this step when
    due or when Slurm's warning signal came during it (``state``: the driver's part). Records
    ``time/checkpoint_blocked``; returns whether the run stops after this step."""
    blocked = ckpt.settle(actors)
    # Read once: the save and the stop must agree (a signal landing between two reads would stop the
    # run without its checkpoint). A later signal is taken at the next step.
    stop = REQUEST.asked
    if checkpoint_due(cfg, step) or stop:  # a stop's save must finish before the run ends
        last_one = stop or step == cfg.algo.max_steps
        blocked += ckpt.save(step, actors, state(), metrics, cfg.checkpoint.async_save and not last_one)
    metrics["time/checkpoint_blocked"] = blocked
    return stop


def report(
    cfg: RunConfig, step: int, metrics: dict[str, float], stop: bool, logger: Any, say: Callable[[str], None]
) -> None:
    """Log the step; on a stop, end the run here (the checkpoint is saved)."""
    logger.log(step, metrics)
    say(console_line(step, cfg.algo.max_steps, metrics))
    if stop:
        REQUEST.done(step)
        if step < cfg.algo.max_steps:
            say(f"stopping after step {step} on the scheduler's warning signal: checkpoint saved")
            raise Preempted(step)


def one_step(
    cfg: RunConfig,
    actors: Actors,
    pool: Scorer,
    encode: Callable[[str], list[int]],
    pad_id: int,
    stream: PromptStream,
    val: list[Example],
    step: int,
) -> dict[str, float]:
    """Rollouts and rewards, reference log-probs (KL only), the train step, the weight sync, and the
    validation when due; returns the step's metrics with per-phase times."""
    algo = cfg.algo
    timer, t0 = Timer(), time.perf_counter()
    with timer("rollout"):
        scored, shaped, metrics = collect(cfg, actors, pool, encode, stream, step)
    actors.sleep_engines()  # rollout.sleep: colocated engines free their GPU memory for training
    batch = make_batch(cfg, scored, shaped, encode, pad_id)
    with timer("ref_logprobs"):
        ref = actors.ref_logprobs(batch) if algo.kl_coef > 0 else None
    with timer("train"):
        metrics.update({f"train/{k}": v for k, v in actors.train_step(batch, ref).items()})
    with timer("weight_sync"):
        # asleep: wakes the engines' weights, refits, wakes their KV cache; the refit's phases
        metrics.update({f"refit/{k}": v for k, v in actors.sync_weights(step).items()})
    metrics["train/reward"] = float(shaped.mean())
    if step % algo.val_period == 0 or step == algo.max_steps:
        with timer("validation"):
            metrics.update(validate(cfg, actors, pool, encode, val))
    metrics.update(timer.times)
    metrics["time/step"] = time.perf_counter() - t0
    metrics["perf/gen_tokens_per_s"] = metrics["perf/gen_tokens"] / max(timer.times["time/rollout"], 1e-9)
    return metrics


def run_state(stream: PromptStream, step: int) -> dict[str, Any]:
    """The driver's part of a checkpoint (the trainer ranks write theirs): the prompt stream's
    position, the step, the RNGs."""
    return {
        "stream": stream.state(),
        "step": step,
        "rng": {"python": random.getstate(), "torch": torch.get_rng_state()},
    }
