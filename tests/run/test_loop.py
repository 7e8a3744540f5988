"""``loop.train`` driven by recording fakes, in milliseconds: the order of operations and the batch
contents through dynamic sampling, validation, checkpoints and the preemption stop.

Fakes, named as such: ``FakeActors`` stands for the Ray actors (``hpcrl.run.fleet.Fleet``) and
``FakeScorer`` for the reward pool; both only record and return canned answers. The prompt stream,
advantages, batch building, checkpoint manager and preemption request are the real ones. The same
loop with real actors runs end to end in tests/run/test_embedded.py and tests/launch/test_slurm.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hpcrl.config.compose import compose_config
from hpcrl.data.loader import Example, PromptStream
from hpcrl.rewards.pool import Task
from hpcrl.rewards.verifiers import Outcome, Verdict
from hpcrl.rollout.base import Completion, SamplingSettings
from hpcrl.run import loop, overlap
from hpcrl.run.checkpoint import CheckpointManager, load_loop_state
from hpcrl.run.preempt import REQUEST, Preempted
from hpcrl.run.vision import Encoded
from hpcrl.trainer.batch import TrainBatch

PAD = 0
EXAMPLES = [Example(prompt=f"q{i}", answer=str(i) * (1 + i % 3)) for i in range(10)]
ANSWER = {e.prompt: e.answer for e in EXAMPLES}
VAL = EXAMPLES[:4]


def encode(text: str) -> list[int]:
    return [ord(ch) for ch in text]


def encoded(example: Example) -> Encoded:
    ids = encode(example.prompt)
    return Encoded(ids, ids)


def decode(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


class FakeActors:
    """Records every call; completions are scripted per training ``generate`` call: ``"right"``
    answers every prompt correctly (groups without signal), ``"mixed"`` answers the first of each
    group's ``n`` samples correctly and the rest wrongly. Validation (one greedy sample) answers the
    first half of the validation prompts correctly."""

    def __init__(self, script: list[str], preempt_at_train_step: int | None = None) -> None:
        self.script = list(script)
        self.preempt_at = preempt_at_train_step
        self.calls: list[tuple[Any, ...]] = []
        self.batches: list[TrainBatch] = []
        self.prompts: list[list[str]] = []
        self.seeds: list[int] = []
        self.synced: list[int] = []
        self.handed: list[int] = []
        self.steps = 0

    def generate(self, prompts: list[list[int]], settings: SamplingSettings) -> list[list[Completion]]:
        texts = [decode(p) for p in prompts]
        greedy = settings.temperature == 0.0
        self.calls.append(("validate" if greedy else "generate", len(prompts), settings.n))
        if greedy:
            return [[self._reply(t, t in {e.prompt for e in VAL[:2]})] for t in texts]
        self.prompts.append(texts)
        self.seeds.append(settings.seed)
        mode = self.script.pop(0)
        return [[self._reply(t, mode == "right" or j == 0) for j in range(settings.n)] for t in texts]

    @staticmethod
    def _reply(prompt: str, right: bool) -> Completion:
        text = ANSWER[prompt] if right else "x"
        return Completion(encode(text), [-0.5] * len(text), text, truncated=False)

    def generate_stream(self, prompts: list[list[int]], settings: SamplingSettings) -> Any:
        """The batch in two hand-overs (odd prompts first), as engines finishing at different times."""
        groups = self.generate(prompts, settings)
        for parity in (1, 0):
            self.handed.append(sum(1 for i in range(len(groups)) if i % 2 == parity))
            yield [(i, g) for i, g in enumerate(groups) if i % 2 == parity]

    def train_step(self, batch: TrainBatch, lr: float | None = None) -> dict[str, float]:
        self.steps += 1
        self.calls.append(("train_step", len(batch)))
        self.batches.append(batch)
        if self.steps == self.preempt_at:
            REQUEST.ask()  # as the USR2 handler would, in the middle of the step
        return {"loss": 0.25, "grad_norm": 1.0, "time/ref_logprobs": 0.125}

    def sleep_engines(self) -> None:
        self.calls.append(("sleep_engines",))

    def sync_weights(self, version: int) -> dict[str, float]:
        self.synced.append(version)
        self.calls.append(("sync_weights",))
        return {"total_s": 0.5}

    def save_checkpoint(self, path: str, async_save: bool) -> float:
        """Writes the 'shards' (the step count) into ``path``, as trainer ranks write theirs."""
        self.calls.append(("save_checkpoint", async_save))
        Path(path).mkdir()
        torch.save(torch.tensor([float(self.steps)]), Path(path) / "weights.pt")
        return 0.5

    def finish_checkpoint(self) -> float:
        self.calls.append(("finish_checkpoint",))
        return 0.25


class FakeScorer:
    """Exact-match verdicts: correct when the completion is the answer. Records, at each submit, how
    many groups the engines had handed over (``actors.handed``): scoring starts before the last."""

    def __init__(self, actors: FakeActors | None = None) -> None:
        self.actors = actors
        self.verdicts: dict[int, Verdict] = {}
        self.submitted_at: list[int] = []

    def submit(self, tasks: list[Task]) -> None:
        if self.actors is not None:
            self.submitted_at.append(len(self.actors.handed))
        for t in tasks:
            self.verdicts[t.index] = Verdict(Outcome.correct if t.completion == t.answer else Outcome.wrong)

    def drain(self) -> dict[int, Verdict]:
        out, self.verdicts = self.verdicts, {}
        return out


class Recorder:
    def __init__(self) -> None:
        self.logged: list[tuple[int, dict[str, float]]] = []
        self.shown: list[tuple[int, list[dict[str, Any]]]] = []

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        self.shown.append((step, rows))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.logged.append((step, dict(metrics)))


# tests/conftest.py's fresh_request: no preemption asked before a test, none left after it
pytestmark = pytest.mark.usefixtures("fresh_request")


def config(*overrides: str) -> Any:
    base = [
        "algo.num_prompts_per_step=3",
        "algo.num_generations=2",
        "algo.max_steps=3",
        "algo.val_period=2",
        "checkpoint.period=2",
        "checkpoint.keep_top_k=5",
    ]
    return compose_config([*base, *overrides])


def run(
    cfg: Any, actors: FakeActors, tmp_path: Path, start_step: int = 0, stream: Any = None, scorer: Any = None
) -> Any:
    stream = stream or PromptStream(EXAMPLES, seed=cfg.run.seed)
    ckpt = CheckpointManager(tmp_path / "ckpt", cfg.checkpoint.keep_top_k, "val/accuracy", True)
    logger, said = Recorder(), []
    loop_run = loop.Run(
        cfg, actors, scorer or FakeScorer(), encoded, PAD, stream, VAL, ckpt, logger, said.append
    )
    # as the driver picks: the overlapped loop for max_staleness > 0 (tests/run/test_overlap.py)
    train = overlap.train_overlapped if cfg.algo.max_staleness else loop.train
    last = train(loop_run, start_step=start_step)
    return last, ckpt, logger, said


def test_dynamic_sampling_validation_and_checkpoints_in_order(tmp_path: Path) -> None:
    cfg = config("algo.dynamic_sampling=true", "algo.kl_coef=0.01")
    actors = FakeActors(["right", "mixed"] * 3)
    last, ckpt, logger, said = run(cfg, actors, tmp_path)

    # the engines sleep after generating, before training; the trainers score the reference themselves
    step_ops = [("generate", 3, 2), ("generate", 3, 2), ("sleep_engines",), ("train_step", 6)]
    step_ops.append(("sync_weights",))
    val = ("validate", 4, 1)
    assert actors.calls == [
        val,
        *step_ops,  # step 1: no validation (period 2), no checkpoint
        *step_ops,
        val,
        ("save_checkpoint", True),  # step 2: validation and checkpoint are due; written during step 3
        *step_ops,
        val,
        ("finish_checkpoint",),  # step 2's shards are on disk: committed
        ("save_checkpoint", False),  # step 3: the last step validates and saves, before the run ends
        ("finish_checkpoint",),
    ]
    # each validation shows its first problems as text (4 problems: all of them, default 4)
    assert [step for step, _ in logger.shown] == [0, 2, 3]
    first = logger.shown[0][1]
    assert len(first) == 4 and all(r["prompt"] and r["answer"] for r in first)
    assert {r["outcome"] for _, rows in logger.shown for r in rows} <= {"correct", "wrong", "parse_error"}
    # the first round's groups all agree (no signal) and are dropped: each batch is the second round's
    for batch, prompts in zip(actors.batches, actors.prompts[1::2], strict=True):
        rows = [
            decode(r[m.bool()].tolist()) for r, m in zip(batch.input_ids, batch.attention_mask, strict=True)
        ]
        assert rows == [f"{p}{ANSWER[p] if j == 0 else 'x'}" for p in prompts for j in range(2)]
        assert batch.advantages.tolist() == pytest.approx([0.7071, -0.7071] * 3, abs=1e-4)
        assert batch.loss_mask.sum(dim=1).tolist() == [
            len(ANSWER[p]) if j == 0 else 1 for p in prompts for j in range(2)
        ]
    assert len(set(actors.seeds)) == 6  # every step and every round samples anew
    assert actors.synced == [1, 2, 3]  # the engines learn which policy version they hold
    metrics = dict(logger.logged)
    assert sorted(metrics) == [0, 1, 2, 3]
    assert metrics[0]["val/accuracy"] == 0.5
    assert metrics[1]["train/dynamic_sampling_rounds"] == 2.0
    assert metrics[1]["train/kept_groups"] == 3.0
    assert metrics[1]["train/accuracy"] == pytest.approx(9 / 12)  # 6 of round 1 + 3 of round 2
    assert "val/accuracy" not in metrics[1] and metrics[2]["val/accuracy"] == 0.5
    assert [c.step for c in ckpt.list()] == [2, 3]
    state = load_loop_state(ckpt.latest())
    assert state["step"] == 3 and state["stream"] == {"epoch": 1, "offset": 8}  # 6 steps x 3 prompts of 10
    assert "trainer" not in state  # the ranks' shards are theirs: the driver holds loop state only
    assert torch.load(ckpt.latest().path / "trainer" / "weights.pt").item() == 3.0
    assert torch.load(ckpt.list()[0].path / "trainer" / "weights.pt").item() == 2.0
    blocked = {step: m["time/checkpoint_blocked"] for step, m in metrics.items() if step}
    assert blocked == {1: 0.0, 2: 0.5, 3: 0.25 + 0.5 + 0.25}  # step 3: waits for step 2's, saves its own
    assert last["train/loss"] == 0.25 and last["time/ref_logprobs"] == 0.125  # the trainers' own phase
    assert said[-1].startswith("step   3/3")


def test_without_dynamic_sampling_or_kl_every_group_trains(tmp_path: Path) -> None:
    cfg = config("algo.dynamic_sampling=false", "algo.kl_coef=0.0", "checkpoint.enabled=false")
    actors = FakeActors(["right", "mixed", "right"])
    _, ckpt, logger, _ = run(cfg, actors, tmp_path)

    ops = [c[0] for c in actors.calls]
    assert (
        ops
        == ["validate"]
        + ["generate", "sleep_engines", "train_step", "sync_weights"]
        + ["generate", "sleep_engines", "train_step", "sync_weights", "validate"] * 2
    )
    first = actors.batches[0]  # all-right groups stay in, with zero advantage
    assert len(first) == 6 and first.advantages.abs().max().item() == 0.0
    assert dict(logger.logged)[1]["train/reward"] == 1.0
    assert ckpt.list() == []


def test_preemption_saves_the_step_then_resume_continues_the_same_stream(tmp_path: Path) -> None:
    cfg = config("algo.dynamic_sampling=false", "algo.kl_coef=0.0", "checkpoint.period=10")
    whole = FakeActors(["mixed"] * 3)
    run(cfg, whole, tmp_path / "whole")

    first = FakeActors(["mixed"] * 3, preempt_at_train_step=2)
    with pytest.raises(Preempted) as stopped:
        run(cfg, first, tmp_path / "cut")
    assert stopped.value.step == 2 and REQUEST.step == 2
    ops = [c[0] for c in first.calls]
    assert ops[-3:] == ["validate", "save_checkpoint", "finish_checkpoint"]  # step 2 saved and on disk
    assert first.calls[-2] == ("save_checkpoint", False)  # the stop's save is not left in the background
    ckpt = CheckpointManager(tmp_path / "cut" / "ckpt", 5, "val/accuracy", True)
    assert [c.step for c in ckpt.list()] == [2]  # period 10: only the stop saved

    REQUEST.reset()
    state = load_loop_state(ckpt.latest())
    stream = PromptStream(EXAMPLES, seed=cfg.run.seed)
    stream.restore(state["stream"])
    resumed = FakeActors(["mixed"])
    run(cfg, resumed, tmp_path / "cut", start_step=state["step"], stream=stream)
    assert resumed.calls[0][0] == "generate"  # no validation before a resumed step
    assert resumed.prompts == whole.prompts[2:]  # step 3 sees the prompts it would have seen


def test_completions_are_scored_as_the_engines_hand_them_over(tmp_path: Path) -> None:
    cfg = config("algo.dynamic_sampling=false", "checkpoint.enabled=false", "algo.max_steps=2")
    actors = FakeActors(["mixed"] * 2)
    scorer = FakeScorer(actors)
    _, _, logger, _ = run(cfg, actors, tmp_path, scorer=scorer)
    # each hand-over is submitted before the engines hand over the next: one submit per hand-over
    assert scorer.submitted_at == list(range(1, len(actors.handed) + 1))
    assert dict(logger.logged)[1]["train/accuracy"] == 0.5  # every group's verdicts arrived in place


class RoutedActors(FakeActors):
    """``FakeActors`` whose completions carry routes (``trainer.router_replay``): at each position the
    token there and the prompt's first character, so a row shows whose routes it got."""

    def generate(self, prompts: list[list[int]], settings: SamplingSettings) -> list[list[Completion]]:
        groups = super().generate(prompts, settings)
        for prompt, group in zip(prompts, groups, strict=True):
            for c in group:
                seq = torch.tensor(prompt + c.token_ids[:-1], dtype=torch.int16)
                c.routes = torch.stack([seq, torch.full_like(seq, prompt[0])], -1)[:, None].numpy()
        return groups


def test_routes_travel_with_their_samples_into_the_batch(tmp_path: Path) -> None:
    cfg = config("algo.dynamic_sampling=false", "algo.kl_coef=0.0", "checkpoint.enabled=false")
    actors = RoutedActors(["mixed", "right", "mixed"])
    run(cfg, actors, tmp_path)
    b = actors.batches[0]
    assert b.routes is not None and b.routes.shape == (*b.input_ids.shape, 1, 2)
    for row in range(len(b)):
        n = int(b.attention_mask[row].sum())
        assert torch.equal(b.routes[row, : n - 1, 0, 0], b.input_ids[row, : n - 1].to(torch.int16))
        assert (b.routes[row, : n - 1, 0, 1] == b.input_ids[row, 0]).all()
        assert (b.routes[row, n - 1 :] == -1).all()


class EpisodeActors(FakeActors):
    """``FakeActors`` whose completions are episodes (a loss mask) that spent 0.25 s each in their
    environment (``Completion.env_seconds``, as ``envs/episodes.py`` stamps it)."""

    def generate(self, prompts: list[list[int]], settings: SamplingSettings) -> list[list[Completion]]:
        groups = super().generate(prompts, settings)
        for c in (c for g in groups for c in g):
            c.mask, c.env_seconds = [1] * len(c.token_ids), 0.25
        return groups


@pytest.mark.parametrize("staleness", [0, 1])
def test_each_step_logs_its_batch_s_environment_time(tmp_path: Path, staleness: int) -> None:
    cfg = config(
        "algo.dynamic_sampling=false",
        "checkpoint.enabled=false",
        f"algo.max_staleness={staleness}",
        "algo.is_correction=tis",
    )
    _, _, logger, said = run(cfg, EpisodeActors(["mixed"] * 3), tmp_path)
    steps = [m for step, m in logger.logged if step > 0]
    assert len(steps) == 3
    # 3 prompts x 2 episodes x 0.25 s, whichever loop made the batch
    assert all(m["time/environment"] == pytest.approx(1.5) for m in steps)
    assert "env 1.5s" in said[-1]


def test_single_turn_steps_log_no_environment_time(tmp_path: Path) -> None:
    cfg = config("algo.dynamic_sampling=false", "checkpoint.enabled=false", "algo.max_steps=1")
    _, _, logger, _ = run(cfg, FakeActors(["mixed"]), tmp_path)
    assert "time/environment" not in dict(logger.logged)[1]
