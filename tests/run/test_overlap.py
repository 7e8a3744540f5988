"""``algo.max_staleness`` (issue 20): generation of step s + N's batch overlaps training of step s.

Driven by tests/run/test_loop.py's recording fakes (named as such there), extended to keep weight versions:
the trainer's version is its number of optimizer steps, the engines' the version last synced to them,
and each completion's log-prob says which version generated it. The prompt stream, batch building,
checkpoint manager and preemption request are the real ones; the real loop on Ray runs in
tests/run/test_embedded.py.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from hpcrl.config.compose import compose_config
from hpcrl.data.loader import PromptStream
from hpcrl.errors import ConfigError
from hpcrl.rollout.base import Completion, SamplingSettings
from hpcrl.run.checkpoint import CheckpointManager, load_loop_state
from hpcrl.run.engine_faults import EngineFailed
from hpcrl.run.preempt import REQUEST, Preempted
from hpcrl.trainer.batch import TrainBatch
from tests.run.test_loop import EXAMPLES, FakeActors, FakeScorer, Recorder, config, encoded, run


class VersionedActors(FakeActors):
    """FakeActors whose sampled tokens' log-probs are -(1 + the engines' version), so a batch shows
    which weights made it. A train step waits (up to 5 s) for the next batch's generation to finish
    and records whether it did: only a loop that generates while training sees it finish."""

    def __init__(self, script: list[str], preempt_at_train_step: int | None = None) -> None:
        super().__init__(script, preempt_at_train_step)
        self.engine_version = 0
        self.gen_versions: list[int] = []
        self.generated: dict[int, threading.Event] = {}
        self.overlapped: list[bool] = []
        self.generating = False
        self.clashes: list[str] = []
        self.lock = threading.Lock()

    def generate(self, prompts: list[list[int]], settings: SamplingSettings) -> list[list[Completion]]:
        greedy = settings.temperature == 0.0
        with self.lock:
            self.generating = True
        groups = super().generate(prompts, settings)
        for g in groups:
            for c in g:
                c.logprobs = [-(1.0 + self.engine_version)] * len(c.token_ids)
                c.versions = (self.engine_version, self.engine_version)  # as the engines stamp them
        with self.lock:
            self.generating = False
            if not greedy:
                self.gen_versions.append(self.engine_version)
                self.generated.setdefault(len(self.gen_versions), threading.Event()).set()
        return groups

    def train_step(self, batch: TrainBatch, lr: float | None = None) -> dict[str, float]:
        out = super().train_step(batch)
        with self.lock:
            nxt = self.generated.setdefault(self.steps + 1, threading.Event())
        self.overlapped.append(nxt.wait(timeout=5.0))
        return out

    def sync_weights(self, version: int) -> dict[str, float]:
        with self.lock:
            if self.generating:
                self.clashes.append(f"sync while generating, after train step {self.steps}")
            self.engine_version = self.steps
        return super().sync_weights(version)


def lagged(lag: int, *extra: str) -> Any:
    return config(
        "algo.dynamic_sampling=false",
        "algo.kl_coef=0.0",
        "algo.is_correction=tis",
        f"algo.max_staleness={lag}",
        *extra,
    )


def versions_trained(actors: VersionedActors) -> list[int]:
    """The weight version behind each trained batch, read back from its log-probs."""
    return [round(-b.rollout_logp[b.loss_mask.bool()][0].item() - 1) for b in actors.batches]


# tests/conftest.py's fresh_request: no preemption asked before a test, none left after it
pytestmark = pytest.mark.usefixtures("fresh_request")


@pytest.mark.parametrize("lag", [1, 2])
def test_batches_come_from_the_weights_exactly_lag_steps_back(tmp_path: Path, lag: int) -> None:
    steps = 5
    cfg = lagged(lag, f"algo.max_steps={steps}", "checkpoint.enabled=false")
    actors = VersionedActors(["mixed"] * steps)
    _, _, logger, _ = run(cfg, actors, tmp_path)

    want = [max(0, j - 1 - lag) for j in range(1, steps + 1)]  # batch j: the policy after step j-1-N
    assert actors.gen_versions == want
    assert versions_trained(actors) == want
    metrics = dict(logger.logged)
    assert [metrics[s]["async/staleness"] for s in range(1, steps + 1)] == [
        (s - 1) - v for s, v in zip(range(1, steps + 1), want, strict=True)
    ]
    assert all(metrics[s]["async/version_span"] == 0.0 for s in range(1, steps + 1))
    # while step s trained, batch s+1 was generated (the last step has no next batch)
    assert actors.overlapped[: steps - 1] == [True] * (steps - 1)
    assert actors.clashes == []  # weights never changed under a batch being generated


def test_the_overlapped_loop_trains_on_the_prompts_the_on_policy_loop_would(tmp_path: Path) -> None:
    on = FakeActors(["mixed"] * 4)
    run(lagged(0, "algo.max_steps=4", "checkpoint.enabled=false"), on, tmp_path / "on")
    off = VersionedActors(["mixed"] * 4)
    run(lagged(1, "algo.max_steps=4", "checkpoint.enabled=false"), off, tmp_path / "off")
    assert off.prompts == on.prompts and off.seeds == on.seeds
    for a, b in zip(on.batches, off.batches, strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.advantages, b.advantages)


def test_max_staleness_zero_is_the_on_policy_loop(tmp_path: Path) -> None:
    """0 takes the on-policy loop itself: the same calls in the same order as without the key."""
    default, zero = FakeActors(["mixed"] * 3), FakeActors(["mixed"] * 3)
    run(config("algo.dynamic_sampling=false"), default, tmp_path / "a")
    run(config("algo.dynamic_sampling=false", "algo.max_staleness=0"), zero, tmp_path / "b")
    assert zero.calls == default.calls
    ops = [c[0] for c in zero.calls]
    assert ops[:5] == ["validate", "generate", "sleep_engines", "train_step", "sync_weights"]
    for a, b in zip(default.batches, zero.batches, strict=True):
        for x, y in zip(a.__dict__.values(), b.__dict__.values(), strict=True):
            assert torch.equal(x, y) if torch.is_tensor(x) else x == y  # loss_from: an int


def test_a_stop_keeps_the_generated_batch_and_resume_trains_exactly_what_the_whole_run_did(
    tmp_path: Path,
) -> None:
    cfg = lagged(1, "algo.max_steps=4", "checkpoint.period=10")
    whole = VersionedActors(["mixed"] * 4)
    run(cfg, whole, tmp_path / "whole")

    cut = VersionedActors(["mixed"] * 4, preempt_at_train_step=2)
    with pytest.raises(Preempted):
        run(cfg, cut, tmp_path / "cut")
    ckpt = CheckpointManager(tmp_path / "cut" / "ckpt", 5, "val/accuracy", True)
    state = load_loop_state(ckpt.latest())
    assert state["step"] == 2
    # batch 3, made by step 1's weights (the versions the engines stamped on its completions)
    assert [(r.step, {c.versions for g in r.scored.groups for c in g}) for r in state["rollouts"]] == [
        (3, {(1, 1)})
    ]
    assert cut.gen_versions == [0, 0, 1]  # batch 4 was not started: its prompts stay in the stream

    REQUEST.reset()
    stream = PromptStream(EXAMPLES, seed=cfg.run.seed)
    stream.restore(state["stream"])
    resumed = VersionedActors(["mixed"])
    resumed.steps = resumed.engine_version = 2  # as the ranks' load and the resume's weight sync leave it
    ckpt2 = CheckpointManager(tmp_path / "cut" / "ckpt", 5, "val/accuracy", True)
    from hpcrl.run.loop import Run
    from hpcrl.run.overlap import train_overlapped

    logger_calls: list[Any] = []

    class Log:
        def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
            pass

        def log(self, step: int, metrics: dict[str, float]) -> None:
            logger_calls.append(step)

    loop_run = Run(cfg, resumed, FakeScorer(), encoded, 0, stream, [], ckpt2, Log(), lambda _m: None)
    train_overlapped(loop_run, start_step=2, restored=state["rollouts"])
    assert logger_calls == [3, 4]
    assert resumed.gen_versions == [2]  # batch 4, from step 2's weights, as in the whole run
    assert cut.prompts + resumed.prompts == whole.prompts
    for a, b in zip(cut.batches + resumed.batches, whole.batches, strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.rollout_logp, b.rollout_logp)


def test_off_policy_needs_an_importance_correction() -> None:
    with pytest.raises(ConfigError, match=r"algo.max_staleness=1 .* set algo.is_correction=tis"):
        compose_config(["algo.max_staleness=1"])
    with pytest.raises(ConfigError, match=r"algo\.max_staleness"):
        compose_config(["algo.max_staleness=-1", "algo.is_correction=tis"])


def test_engines_that_generate_during_training_do_not_sleep() -> None:
    from hpcrl.plan.planner import make_plan as plan

    base = ["+cluster=h200", "cluster.slurm.account=a", "cluster.container.image=i", "model=qwen2_1p5b"]
    assert plan(compose_config(base)).cfg.rollout.sleep is True
    p = plan(compose_config([*base, "algo.max_staleness=1", "algo.is_correction=tis"]))
    assert p.cfg.rollout.sleep is False and "max_staleness" in p.sleep.reason
    with pytest.raises(ConfigError, match=r"rollout\.sleep=true needs colocated GPUs"):
        plan(compose_config([*base, "algo.max_staleness=1", "algo.is_correction=tis", "rollout.sleep=true"]))


class InflightActors(VersionedActors):
    """Training batch j > 1 waits (up to 5 s) for the weights of step j - 1, which the loop syncs
    after training step j - 1 while batch j is in flight, and records whether they came: in flight
    they do; otherwise the loop waits for batch j before that sync."""

    def __init__(self, script: list[str]) -> None:
        super().__init__(script)
        self.synced_during: list[bool] = []
        self.version_seen = threading.Condition()

    def generate(self, prompts: list[list[int]], settings: SamplingSettings) -> list[list[Completion]]:
        if settings.temperature > 0 and self.gen_versions:  # not validation, not the first batch
            j = len(self.gen_versions) + 1
            with self.version_seen:
                came = self.version_seen.wait_for(lambda: self.engine_version >= j - 1, timeout=5.0)
            self.synced_during.append(came)
        return super().generate(prompts, settings)

    def train_step(self, batch: TrainBatch, lr: float | None = None) -> dict[str, float]:
        return FakeActors.train_step(self, batch)  # no wait for the next batch here

    def sync_weights(self, version: int) -> dict[str, float]:
        with self.version_seen:
            self.engine_version = version
            self.version_seen.notify_all()
        return FakeActors.sync_weights(self, version)


@pytest.mark.parametrize("inflight", [True, False])
def test_inflight_updates_land_under_the_running_batch(tmp_path: Path, inflight: bool) -> None:
    extra = ("algo.max_steps=4", "algo.val_period=100", "checkpoint.enabled=false")
    cfg = lagged(1, *extra, f"rollout.inflight_update={str(inflight).lower()}")
    actors = InflightActors(["mixed"] * 4)
    run(cfg, actors, tmp_path)
    # batches 2..4 run while steps 1..3 train; in flight, each step's sync lands inside the next batch
    assert actors.synced_during == [inflight] * 3


def test_inflight_update_needs_the_overlapped_loop() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.inflight_update=true .* algo\.max_staleness=1"):
        compose_config(["rollout.inflight_update=true"])


def test_resume_with_a_lower_lag_drops_batches_older_than_the_new_limit():
    """Saved after step 3 with lag 2: the batches for steps 4 and 5 were made by the policies after
    steps 1 and 2. Resumed with lag 1, step 4's batch would train 2 versions behind (4 - 1 - 1 = 2 >
    1): dropped; step 5's is 2 behind its step too (5 - 1 - 2 = 2) and beyond the new horizon (5 > 3
    + 1): dropped. With lag 2 both stay; a batch spanning versions counts its oldest token."""
    from types import SimpleNamespace

    from hpcrl.run.overlap import Rollouts, resumable

    def batch(step: int, *versions: tuple[int, int]) -> Rollouts:
        group = [Completion([1], [0.0], "", False, v) for v in versions]
        return Rollouts(step, SimpleNamespace(groups=[group]), torch.zeros(1), {}, 0.0)

    saved = [batch(4, (1, 1)), batch(5, (2, 2))]
    assert [r.step for r in resumable(saved, 3, 2)] == [4, 5]
    assert resumable(saved, 3, 1) == []
    assert [r.step for r in resumable([batch(4, (2, 2))], 3, 1)] == [4]  # made after step 2: 1 behind
    assert resumable([batch(4, (1, 2), (2, 2))], 3, 1) == []  # its oldest token is 2 behind


class FailingEngines(VersionedActors):
    """VersionedActors (a train step does not wait for the next batch) whose engines fail past
    ``rollout.max_engine_restarts`` (``EngineFailed``, as the fleet raises it): in the refit to
    ``refit``, or in the ``generation``-th training batch after its first hand-over."""

    LINE = (
        "rollout engine 0 on node1 failed (died: ActorDiedError): 2 engine failures in this run, more than x"
    )

    def __init__(self, script: list[str], refit: int = 0, generation: int = 0, ahead: int = 0) -> None:
        super().__init__(script)
        self.refit, self.generation, self.ahead, self.total = refit, generation, ahead, len(script)

    def generate_stream(self, prompts: list[list[int]], settings: SamplingSettings) -> Any:
        for n, part in enumerate(super().generate_stream(prompts, settings)):
            if n == 1 and settings.temperature > 0 and len(self.gen_versions) == self.generation:
                raise EngineFailed(self.LINE)
            yield part

    def train_step(self, batch: TrainBatch, lr: float | None = None) -> dict[str, float]:
        """``ahead``: train step s ends once batch s + ``ahead`` was made (a failed one too), so which
        batches were begun when the loop finds a failure does not depend on the threads' timing."""
        out = FakeActors.train_step(self, batch)
        if self.ahead and self.steps + self.ahead <= self.total:
            with self.lock:
                made = self.generated.setdefault(self.steps + self.ahead, threading.Event())
            made.wait(timeout=5.0)
        return out

    def sync_weights(self, version: int) -> dict[str, float]:
        if version == self.refit:
            raise EngineFailed(self.LINE)
        return super().sync_weights(version)


def stop_and_resume(cfg: Any, cut: FailingEngines, where: Path) -> tuple[str, dict[str, Any], FailingEngines]:
    """The overlapped loop until ``cut``'s engines fail, the driver's save and stop line
    (``engine_faults.save_and_stop``), then the resume from that checkpoint as the driver makes it
    (stream position, kept batches, the trainers' and engines' version)."""
    from hpcrl.run.engine_faults import save_and_stop
    from hpcrl.run.loop import Run
    from hpcrl.run.overlap import resumable, train_overlapped

    def loop_run(actors: FakeActors) -> Run:
        stream = PromptStream(EXAMPLES, seed=cfg.run.seed)
        ckpt = CheckpointManager(where / "ckpt", 5, "val/accuracy", True)
        return Run(cfg, actors, FakeScorer(), encoded, 0, stream, [], ckpt, Recorder(), lambda _m: None)

    first = loop_run(cut)
    with pytest.raises(EngineFailed) as failed:
        train_overlapped(first)
    line = str(save_and_stop(first, cut.steps, failed.value))
    state = load_loop_state(first.ckpt.latest())
    resumed = FailingEngines(["mixed"] * 4)
    resumed.steps = resumed.engine_version = state["step"]  # the ranks' load and the resume's weight sync
    again = loop_run(resumed)
    again.stream.restore(state["stream"])
    kept = resumable(state["rollouts"], state["step"], cfg.algo.max_staleness)
    train_overlapped(again, start_step=state["step"], restored=kept)
    return line, state, resumed


def test_a_stop_at_the_restart_bound_keeps_the_generated_batch_and_resume_trains_what_the_whole_run_did(
    tmp_path: Path,
) -> None:
    """The refit to step 2's weights fails past the bound; batch 3 (step 1's weights) is complete: the
    checkpoint of step 2 keeps it, as a preemption's would, and the resume trains it, then batch 4 from
    step 2's weights: every batch as in the unbroken run."""
    cfg = lagged(1, "algo.max_steps=4", "checkpoint.period=10")
    whole = FailingEngines(["mixed"] * 4)
    run(cfg, whole, tmp_path / "whole")
    cut = FailingEngines(["mixed"] * 4, refit=2)
    line, state, resumed = stop_and_resume(cfg, cut, tmp_path / "cut")
    assert line == (
        f"{FailingEngines.LINE}: stopped after saving step 2 with the batch for step 3 generated; submit "
        "again to resume"
    )
    assert state["step"] == 2
    assert [(r.step, {c.versions for g in r.scored.groups for c in g}) for r in state["rollouts"]] == [
        (3, {(1, 1)})
    ]
    assert resumed.gen_versions == [2]  # batch 4 only, from step 2's weights
    assert cut.prompts + resumed.prompts == whole.prompts
    for a, b in zip(cut.batches + resumed.batches, whole.batches, strict=True):
        assert torch.equal(a.input_ids, b.input_ids)
        assert torch.equal(a.rollout_logp, b.rollout_logp)


def test_a_batch_the_failing_engines_left_incomplete_is_dropped_and_made_again_from_its_prompts(
    tmp_path: Path,
) -> None:
    """Lag 2: batch 4 (step 1's weights) fails half made while step 2 trains; batch 3 is complete. The
    checkpoint of step 2 keeps batch 3 and the stream's position before batch 4's prompts, the stop
    line says so, and the resume makes batch 4 again from the same prompts, with step 2's weights."""
    cfg = lagged(2, "algo.max_steps=5", "checkpoint.period=10")
    whole = FailingEngines(["mixed"] * 5)
    run(cfg, whole, tmp_path / "whole")
    cut = FailingEngines(["mixed"] * 5, generation=4)
    line, state, resumed = stop_and_resume(cfg, cut, tmp_path / "cut")
    assert line == (
        f"{FailingEngines.LINE}: stopped after saving step 2 with the batch for step 3 generated (the batch "
        "for step 4, left incomplete by the failing engines, dropped: the resume makes it again); submit "
        "again to resume"
    )
    assert [r.step for r in state["rollouts"]] == [3]
    assert cut.gen_versions == [0, 0, 0, 1]
    assert resumed.gen_versions == [2, 2]  # batches 4 and 5
    assert resumed.prompts[0] == cut.prompts[3]  # the dropped batch's prompts, made again
    assert cut.prompts[:3] + resumed.prompts == whole.prompts
    assert versions_trained(cut) + versions_trained(resumed) == [0, 0, 0, 2, 2]


def test_with_inflight_updates_a_failed_batch_is_found_when_its_step_takes_it_and_dropped_with_the_next(
    tmp_path: Path,
) -> None:
    """In-flight updates: the loop waits for a batch only when its step takes it. Batch 4 fails half made;
    batch 5, begun after it, is made; step 4 finds batch 4 failed. The checkpoint of step 3 keeps no
    batch (a resume's pipeline has no gaps) and the stream's position before batch 4's prompts: the
    resume makes both again from them."""
    extra = (
        "algo.max_steps=5",
        "checkpoint.period=10",
        "algo.val_period=100",
        "rollout.inflight_update=true",
    )
    cfg = lagged(2, *extra)
    whole = FailingEngines(["mixed"] * 5)
    run(cfg, whole, tmp_path / "whole")
    cut = FailingEngines(["mixed"] * 5, generation=4, ahead=2)  # batch 5 begun before step 4 takes 4
    line, state, resumed = stop_and_resume(cfg, cut, tmp_path / "cut")
    assert line == (
        f"{FailingEngines.LINE}: stopped after saving step 3 (the batch for step 4, left incomplete by the "
        "failing engines, and the batch for step 5 after it, dropped: the resume makes them again); submit "
        "again to resume"
    )
    assert state["step"] == 3
    assert state["rollouts"] == []
    assert len(cut.prompts) == 5
    assert len(resumed.prompts) == 2  # batches 4 and 5 made again
    assert cut.prompts[:3] + resumed.prompts == whole.prompts
    assert resumed.gen_versions == [3, 3]
