"""reasoning-gym as a data source (``data.source=reasoning_gym:<task>``): problems generated from the
run's seed, train and validation disjoint, scored by the task's own checker through hpcrl's verifier
registry and reward pool. Real reasoning-gym throughout; the loop itself: tests/run/test_embedded.py."""

from __future__ import annotations

import re

import pytest

from hpcrl.data import procedural
from hpcrl.data.config import DataConfig
from hpcrl.data.loader import load_examples
from hpcrl.errors import ConfigError
from hpcrl.rewards.config import RewardsConfig
from hpcrl.rewards.pool import RewardPool, Task
from hpcrl.rewards.verifiers import REGISTRY, Outcome
from tests.conftest import compose, run_cli

CHAIN_SUM = ("data=reasoning_gym_chain_sum", "data.num_samples=300", "data.max_val_samples=50")


def reference(example) -> str:
    """The task's oracle answer, carried in the example's answer with the rest of its entry."""
    return procedural.decode_answer(example.answer)[2]["answer"]


def test_generated_from_the_seed_with_train_and_validation_disjoint():
    cfg = compose(*CHAIN_SUM).data
    train, val = load_examples(cfg, seed=7)
    assert (len(train), len(val)) == (300, 50)  # data.num_samples, data.max_val_samples
    assert load_examples(cfg, seed=7) == (train, val)  # the same problems on every run
    other_train, other_val = load_examples(cfg, seed=8)
    assert other_train != train and other_val != val  # another run.seed, other problems
    assert not {e.prompt for e in train} & {e.prompt for e in val}
    assert len({e.prompt for e in val}) == 50  # distinct validation problems
    question = "State the final answer to the following arithmetic problem: "
    assert train[0].prompt.startswith(question) and train[0].prompt.endswith("</answer> tags.")


def test_a_small_task_still_holds_its_validation_problems_out():
    """basic_arithmetic with two numbers up to 10: 242 problems, 128 of them for validation; training
    draws from the rest only (with repeats). The prompt is the entry's bare expression, completed with
    "=" (the tiny models' format): the task's question asks the same."""
    cfg = compose("data=reasoning_gym_basic_arithmetic").data
    train, val = load_examples(cfg, seed=0)
    assert len(train) == 4096 and len(val) == 128
    assert not {e.prompt for e in train} & {e.prompt for e in val}
    for e in train[:200] + val:
        assert re.fullmatch(r"(10|\d) [+-] (10|\d) =", e.prompt), e.prompt
        entry = procedural.decode_answer(e.answer)[2]
        assert entry["question"] == f"Calculate {e.prompt[:-2]}." and entry["answer"] == str(
            eval(e.prompt[:-2])
        )
    too_many = compose("data=reasoning_gym_basic_arithmetic", "data.max_val_samples=300").data
    with pytest.raises(ConfigError, match="too few distinct problems"):
        load_examples(too_many, seed=0)


def test_its_own_checker_scores_through_the_verifier_registry():
    cfg = compose(*CHAIN_SUM).data
    verify = REGISTRY[cfg.verifier]
    example = load_examples(cfg, seed=0)[1][0]
    right = reference(example)
    wrong = str(int(right) + 1)

    def judge(completion: str) -> tuple[Outcome, float]:
        verdict = verify(completion, example.answer, example.prompt)
        return verdict.outcome, verdict.reward

    assert judge(f"Adding term by term.\n<answer>{right}</answer>") == (Outcome.correct, 1.0)
    assert judge(f"<answer>{wrong}</answer>") == (Outcome.wrong, 0.0)
    assert judge(f"<answer>{wrong}</answer> no, <answer>{right}</answer>") == (
        Outcome.correct,
        1.0,
    )  # the last
    assert judge("") == (Outcome.parse_error, 0.0)
    # inside tags, the task's own partial credit: the oracle inside a longer answer
    outcome, reward = judge(f"<answer>{right} or {wrong}</answer>")
    assert outcome is Outcome.wrong and 0 < reward < 1
    # no tags: the completion is the answer, and only an exact one counts (a substring is no answer)
    assert judge(f" {right}\n") == (Outcome.correct, 1.0)
    assert judge(f"{right} {wrong}") == (Outcome.wrong, 0.0)
    assert judge(f"I think it is {right}") == (Outcome.wrong, 0.0)


def test_metadata_survives_the_trip_to_the_reward_process():
    """arc_agi's entries hold tuples that its checker compares with: plain JSON would turn them into
    lists and score the oracle answer 0.05 instead of 1."""
    cfg = DataConfig(
        name="arc", source="reasoning_gym:arc_agi", verifier="reasoning_gym", prompt_field="question"
    )
    cfg.num_samples, cfg.max_val_samples = 2, 1
    train, _ = load_examples(cfg, seed=0)
    for example in train:
        verdict = REGISTRY["reasoning_gym"](reference(example), example.answer, example.prompt)
        assert verdict.outcome is Outcome.correct, verdict
    entry = {"m": (1, (2, 3)), "s": {4, 5}, "k": {6: "x", (7, 8): "y"}, "t": {"__tuple__": 1}}
    assert procedural.decode_answer(procedural.encode_answer("t", {}, entry))[2] == entry


@pytest.mark.slow
def test_reward_processes_score_with_the_task_checker():
    """The verifier in the reward pool's own processes (spawned: reasoning-gym imported there)."""
    cfg = compose(*CHAIN_SUM).data
    examples = load_examples(cfg, seed=0)[1][:3]
    tasks = []
    for i, e in enumerate(examples):
        tasks += [Task(2 * i, f"<answer>{reference(e)}</answer>", e.answer, e.prompt)]
        tasks += [Task(2 * i + 1, f"<answer>{int(reference(e)) - 3}</answer>", e.answer, e.prompt)]
    with RewardPool(cfg.verifier, RewardsConfig(processes=1, timeout_s=30)) as pool:
        assert pool.score(tasks) == [Outcome.correct, Outcome.wrong] * 3


def test_task_options_from_the_command_line():
    cfg = compose(*CHAIN_SUM, "data.task_options.max_terms=2", "data.task_options.max_digits=1").data
    assert cfg.task_options["max_terms"] == 2
    for e in load_examples(cfg, seed=0)[0][:50]:
        expression = e.prompt.split(": ", 1)[1].split(" =")[0]
        assert len(expression.split()) <= 3 and all(len(t) == 1 for t in expression.split()), expression


RG = "data=reasoning_gym_chain_sum"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            [RG, "data.source=reasoning_gym:chain_summ"],
            "data.source=reasoning_gym:chain_summ is not a reasoning-gym task; use one of: ",
        ),
        (
            [RG, "+data.task_options.max_term=3"],
            "data.task_options.max_term is not an option of reasoning-gym's chain_sum; its options: "
            "allow_negation, max_digits, max_terms, min_digits, min_terms",
        ),
        ([RG, "+data.task_options.seed=3"], "data.task_options.seed is set by hpcrl from run.seed; drop it"),
        (
            [RG, "data.task_options.min_terms=0"],
            "is refused by reasoning-gym's chain_sum: min_terms must be positive",
        ),
        (
            [RG, "data.prompt_field=problem"],
            "data.prompt_field=problem is not a field of reasoning-gym's chain_sum entries; use one of: "
            "question, metadata.source_dataset, metadata.source_index, metadata.num_terms",
        ),
        (
            [RG, "data.verifier=math"],
            "data.source=reasoning_gym:chain_sum is scored by the task's own checker",
        ),
        ([RG, "data.val_source=val.jsonl"], "a reasoning_gym source generates its own validation set"),
        (["data=gsm8k", "data.verifier=reasoning_gym"], "data.verifier=reasoning_gym scores reasoning-gym"),
        (
            ["data=gsm8k", "+data.task_options.max_terms=2"],
            "data.task_options are for data.source=reasoning_gym",
        ),
    ],
)
def test_refused_before_anything_runs(overrides, message):
    with pytest.raises(ConfigError) as err:
        compose(*overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_an_unknown_task_is_one_line_from_the_cli():
    result = run_cli("plan", "data=reasoning_gym_chain_sum", "data.source=reasoning_gym:no_such_task")
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "no_such_task is not a reasoning-gym task" in lines[0], result.stderr
    assert "basic_arithmetic" in lines[0] and "chain_sum" in lines[0]  # the choices


def test_eval_reads_the_generated_validation_problems():
    from hpcrl.tools.evaluate import eval_examples

    cfg = compose("data=reasoning_gym_chain_sum", "data.max_val_samples=12")
    examples = eval_examples(cfg)
    assert examples == load_examples(cfg.data, cfg.run.seed)[1] and len(examples) == 12
