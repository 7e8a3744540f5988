"""Rewards: real math-verify in reward processes with a hard per-sample time limit."""

from __future__ import annotations

import time

import pytest

from hpcrl.rewards.config import RewardsConfig
from hpcrl.rewards.pool import RewardPool, Task
from hpcrl.rewards.verifiers import Outcome, get_verifier, math_verify, math_verify_structural


@pytest.mark.parametrize(
    ("completion", "answer", "outcome"),
    [
        ("The answer is \\boxed{\\frac{1}{2}}", "0.5", Outcome.correct),
        ("\\boxed{0.5}", "\\frac{1}{2}", Outcome.correct),
        ("47", "47", Outcome.correct),
        ("-3", "-3", Outcome.correct),
        ("48", "47", Outcome.wrong),
        ("15 16", "15", Outcome.wrong),  # math-verify reads the last number
        ("no idea", "47", Outcome.parse_error),
    ],
)
def test_math_verify(completion, answer, outcome):
    assert math_verify(completion, answer).outcome is outcome


def test_structural_check_rejects_unfactored_answer():
    prompt = "Factor the expression 1/x^2 + 2/x + 1."
    unfactored = "\\boxed{\\frac{1}{x^2} + \\frac{2}{x} + 1}"
    factored = "\\boxed{\\frac{(x+1)^2}{x^2}}"
    answer = "\\frac{(x+1)^2}{x^2}"
    assert math_verify(unfactored, answer, prompt).outcome is Outcome.correct  # SymPy: equal
    assert math_verify_structural(unfactored, answer, prompt).outcome is Outcome.wrong
    assert math_verify_structural(factored, answer, prompt).outcome is Outcome.correct


def test_unknown_verifier_names_the_registered_ones():
    with pytest.raises(KeyError, match=r"registered: .*math"):
        get_verifier("nope")


@pytest.mark.slow
def test_pool_survives_hanging_crashing_and_raising_verifiers(monkeypatch):
    monkeypatch.setenv("HPCRL_PLUGINS", "tests.verifier_plugins")
    with RewardPool("test_adversarial", RewardsConfig(processes=2, timeout_s=1.0)) as pool:
        tasks = [Task(i, c, "ok", "") for i, c in enumerate(["ok", "hang", "no", "crash", "raise", "ok"])]
        start = time.monotonic()
        out = pool.score(tasks)
        elapsed = time.monotonic() - start
        assert out == [
            Outcome.correct,
            Outcome.timeout,
            Outcome.wrong,
            Outcome.error,
            Outcome.error,
            Outcome.correct,
        ]
        assert pool.restarts == 2  # the hung and the crashed process were replaced
        assert elapsed < 10
        # the pool still works after the replacements
        assert pool.score([Task(0, "ok", "ok", "")]) == [Outcome.correct]


@pytest.mark.slow
def test_process_start_up_does_not_count_against_the_first_sample(monkeypatch):
    """Reward processes warm up (imports, first-call parser builds) before taking work: a 2 s first call
    with a 1 s limit per sample times nothing out."""
    monkeypatch.setenv("HPCRL_PLUGINS", "tests.verifier_plugins")
    with RewardPool("test_slow_first_call", RewardsConfig(processes=2, timeout_s=1.0)) as pool:
        out = pool.score([Task(i, c, "ok", "") for i, c in enumerate(["ok", "no", "ok"])])
    assert out == [Outcome.correct, Outcome.wrong, Outcome.correct]


@pytest.mark.slow
def test_pool_scores_math_in_processes():
    with RewardPool("math", RewardsConfig(processes=2)) as pool:
        tasks = [
            Task(i, c, a, "") for i, (c, a) in enumerate([("\\boxed{2}", "2"), ("3", "2"), ("x", "2")] * 20)
        ]
        out = pool.score(tasks)
    assert out[:3] == [Outcome.correct, Outcome.wrong, Outcome.parse_error]
    assert out.count(Outcome.correct) == 20


@pytest.mark.slow
def test_a_process_that_does_not_start_in_time_stops_the_pool_naming_the_key():
    with RewardPool("math", RewardsConfig(processes=1, start_timeout_s=0.01)) as pool:  # noqa: SIM117
        with pytest.raises(RuntimeError, match=r"rewards\.start_timeout_s"):
            pool.score([Task(0, "\\boxed{2}", "2", "")])
