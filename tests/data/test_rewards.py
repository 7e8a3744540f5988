"""Rewards: real math-verify in reward processes with a hard per-sample time limit."""

from __future__ import annotations

import math

import pytest

from hpcrl.errors import HpcrlError
from hpcrl.rewards import verifiers
from hpcrl.rewards.config import BUILT_IN_VERIFIERS, VERIFIER_NAMES, RewardsConfig
from hpcrl.rewards.pool import RewardPool, Task
from hpcrl.rewards.screen import answer_region, out_of_reach
from hpcrl.rewards.verifiers import (
    REGISTRY,
    Outcome,
    Verdict,
    get_verifier,
    math_verify,
    math_verify_structural,
    read_percent,
    reward_of,
)


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


def test_the_schema_names_each_built_in_verifier():
    """``hpcrl plan`` checks data.verifier against rewards/config.py's names, without importing the
    verifiers: those names are the ones verifiers.py registers, and each registered name is among them."""
    built_in = {name for name, fn in REGISTRY.items() if fn.__module__ == verifiers.__name__}
    assert built_in == set(BUILT_IN_VERIFIERS)
    assert set(REGISTRY) <= VERIFIER_NAMES


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
def test_pool_survives_hanging_crashing_raising_and_memory_eating_verifiers(monkeypatch):
    """Each costs its own sample (scored 0, said once with the first reason), never the batch; a
    verifier eating memory stops at rewards.memory_mb in its own process, which lives on."""
    monkeypatch.setenv("HPCRL_PLUGINS", "tests.harness.verifier_plugins")
    said: list[str] = []
    settings = RewardsConfig(processes=2, timeout_s=2.0, memory_mb=300)
    with RewardPool("test_adversarial", settings, warn=said.append) as pool:
        kinds = ["ok", "hang", "no", "crash", "raise", "eat", "ok"]
        tasks = [Task(i, c, "ok", "") for i, c in enumerate(kinds)]
        out = pool.score(tasks)
        assert out == [
            Outcome.correct,
            Outcome.timeout,
            Outcome.wrong,
            Outcome.error,
            Outcome.error,
            Outcome.error,
            Outcome.correct,
        ]
        assert pool.restarts == 2  # the hung and the crashed process were replaced, not the eater's
        assert len(said) == 1 and "failed on 4 of 7 samples, the first with no verdict within" in said[0]
        # the pool still works after the replacements, and says nothing more
        assert pool.score([Task(0, "ok", "ok", ""), Task(1, "eat", "ok", "")]) == [
            Outcome.correct,
            Outcome.error,
        ]
        assert len(said) == 1
        with pytest.raises(HpcrlError) as stop:
            pool.score([Task(i, "eat", "ok", "") for i in range(3)])
    assert str(stop.value).startswith(
        "verifier 'test_adversarial' failed on all 3 samples of a batch, the first with MemoryError"
    )
    assert "(over rewards.memory_mb=300)" in str(stop.value) and "\n" not in str(stop.value)


def test_a_plugin_that_does_not_import_says_so_in_one_line(monkeypatch):
    monkeypatch.setenv("HPCRL_PLUGINS", "tests.harness.no_such_plugin")
    with pytest.raises(HpcrlError) as info:
        RewardPool("math", RewardsConfig(processes=1))
    assert str(info.value) == (
        "verifier 'math' cannot start: ModuleNotFoundError: No module named 'tests.harness.no_such_plugin' "
        "(HPCRL_PLUGINS=tests.harness.no_such_plugin)"
    )


@pytest.mark.slow
def test_a_reward_process_that_cannot_load_its_plugin_stops_the_pool_in_one_line(monkeypatch):
    """Not a restart loop until rewards.start_timeout_s: the first process's reason, at once."""
    monkeypatch.setenv("HPCRL_PLUGINS", "tests.harness.verifier_plugin_no_start")
    with RewardPool("test_no_start", RewardsConfig(processes=1)) as pool:  # noqa: SIM117
        with pytest.raises(HpcrlError) as info:
            pool.score([Task(0, "x", "x", "")])
    assert str(info.value) == (
        "reward process for verifier 'test_no_start' cannot start: ImportError: No module named "
        "'sympy_extras' (this node's environment lacks it) (plugins: tests.harness.verifier_plugin_no_start)"
    )


@pytest.mark.slow
def test_a_process_that_died_while_idle_is_replaced_and_loses_no_task():
    import signal

    with RewardPool("math", RewardsConfig(processes=1)) as pool:
        assert pool.score([Task(0, "\\boxed{2}", "2", "")]) == [Outcome.correct]
        dead = pool.slots[0].proc
        dead.kill()  # as the OOM killer would, between two batches
        dead.join(timeout=10)
        assert dead.exitcode == -signal.SIGKILL
        assert pool.score([Task(0, "\\boxed{2}", "2", ""), Task(1, "3", "2", "")]) == [
            Outcome.correct,
            Outcome.wrong,
        ]
        assert pool.restarts == 1


@pytest.mark.slow
def test_process_start_up_does_not_count_against_the_first_sample(monkeypatch):
    """Reward processes warm up (imports, first-call parser builds) before taking work: a 2 s first call
    with a 1 s limit per sample times nothing out."""
    monkeypatch.setenv("HPCRL_PLUGINS", "tests.harness.verifier_plugins")
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
        with pytest.raises(HpcrlError, match=r"rewards\.start_timeout_s"):
            pool.score([Task(0, "\\boxed{2}", "2", "")])


LEGIT = [  # answers with powers, factorials and fractions that must reach math-verify and verify
    ("\\boxed{2^{10}}", "1024"),
    ("\\boxed{5!}", "120"),
    ("\\boxed{\\frac{1}{2}}", "0.5"),
    ("\\boxed{10!}", "3628800"),
    ("\\boxed{\\frac{10!}{8!}}", "90"),
    ("\\boxed{2^{100}}", "1267650600228229401496703205376"),
    ("\\boxed{2^{2^{2^{2}}}}", "65536"),
    ("\\boxed{9^{9}}", "387420489"),
    ("\\boxed{3 \\times 10^{8}}", "300000000"),
    ("\\boxed{1.5 \\cdot 10^{-5}}", "0.000015"),
    ("\\boxed{2^{-3}}", "\\frac{1}{8}"),
    ("\\boxed{\\left(\\frac{1}{2}\\right)^{3}}", "\\frac{1}{8}"),
    ("\\boxed{\\sqrt{2}^{10}}", "32"),
    ("\\boxed{e^{x^{2}}}", "e^{x^2}"),
    ("\\boxed{\\frac{(x+1)^{2}}{x^{2}}}", "\\frac{(x+1)^2}{x^2}"),
    ("\\boxed{\\binom{10}{3}}", "120"),
    ("\\boxed{10^{100}}", "10^{100}"),
    ("\\boxed{1000!}", "1000!"),
    ("so 2^{10} = \\boxed{1024}", "1024"),
    ("The answer is 5! = 120", "120"),
    ("\\boxed{\\frac{1}{2}", "0.5"),  # a box cut off by the token limit: math-verify still reads it
    ("\\boxed{x^{2024}}", "x^{2024}"),  # a letter to any power stays symbolic
    ("\\boxed{(x+1)^{3}}", "(x+1)^3"),
    ("\\boxed{\\sum_{k=1}^{3} k}", "\\sum_{k=1}^{3} k"),  # a reference with a sum turns that part off
    ("The sum $\\sum_{k=1}^{3} k$ is $6$.", "6"),  # working before the answer is not the answer
]

PATHOLOGICAL = [  # each kept SymPy busy for seconds or forever (measured; see rewards/screen.py)
    "\\boxed{9^{9^{9^{9}}}}",
    "The answer is 9^9^9^9",
    "\\boxed{x^{9^{9^{9}}}}",
    "\\boxed{10^{100000000}}",
    "\\boxed{100000!}",
    "\\boxed{(10^{6})!}",
    "\\boxed{\\left(10^{6}\\right)!}",
    "\\boxed{" + "\\frac{1}{" * 20 + "2" + "}" * 20 + "}",
    "\\boxed{" + "+".join(f"{i}x^{{{i}}}" for i in range(200)) + "}",
    "\\boxed{\\sum_{k=1}^{100000} \\frac{1}{k}}",
    "\\boxed{\\sum_{k=1}^{10^{9}} k^{k}}",
    "\\boxed{\\prod_{k=1}^{10^{6}} (k+1)}",
    "\\boxed{\\int_0^1 x^{50} e^{x} \\sin(x) dx}",
    "\\boxed{\\lim_{n \\to \\infty} (1+1/n)^{n^{2}}}",
    "\\boxed{(1+\\sqrt{2})^{100000}}",
    "So the answer is $\\sum_{k=1}^{100000} \\frac{1}{k}$.",  # unboxed: the math that ends the text
    "So we get \\[" + "\\frac{1}{" * 16 + "2" + "}" * 16 + "\\]",
]


@pytest.mark.parametrize(("completion", "answer"), LEGIT)
def test_the_screen_passes_legitimate_answers_and_they_verify(completion, answer):
    assert out_of_reach(completion, answer) is None
    assert math_verify(completion, answer).outcome is Outcome.correct


@pytest.mark.parametrize("completion", PATHOLOGICAL)
def test_the_screen_stops_answers_sympy_would_spin_on(completion):
    assert out_of_reach(completion, "47") is not None
    assert math_verify(completion, "47").outcome is Outcome.wrong  # returns: the screen answered


@pytest.mark.parametrize(
    "completion",
    [
        "\\boxed{(-8)^{1/3}}",
        "\\boxed{3.5!}",
        "\\boxed{(0/0)^{5}}",
        "\\boxed{2^{(-8)^{0.5}}}",
        "}^" * 500,
        "n! = 0!",
    ],
)
def test_the_screen_passes_odd_arithmetic_it_cannot_size(completion):
    """Complex, NaN, non-integer factorials, stray brackets: not known to be huge, so SymPy decides."""
    assert out_of_reach(completion, "47") is None


@pytest.mark.parametrize(
    ("reading", "completion", "answer", "outcome"),
    [
        (None, "\\boxed{12}", "12\\%", Outcome.correct),  # math-verify's own reading: one-sided
        (None, "\\boxed{12\\%}", "12", Outcome.wrong),
        (None, "\\boxed{12\\%}", "0.12", Outcome.wrong),
        ("number", "\\boxed{12\\%}", "12", Outcome.correct),
        ("number", "\\boxed{12.5\\%}", "12.5", Outcome.correct),
        ("number", "\\boxed{12\\%}", "0.12", Outcome.wrong),
        ("number", "\\boxed{12}", "12\\%", Outcome.correct),
        ("fraction", "\\boxed{12\\%}", "0.12", Outcome.correct),
        ("fraction", "\\boxed{0.125}", "12.5\\%", Outcome.correct),
        ("fraction", "\\boxed{\\frac{3}{25}}", "12\\%", Outcome.correct),
        ("fraction", "\\boxed{12}", "12\\%", Outcome.wrong),
    ],
)
def test_a_percent_is_read_as_the_data_set_says(reading, completion, answer, outcome):
    """``data.percent``: a unit to drop (number) or a hundredth (fraction); None leaves math-verify's
    one-sided reading, in which a reference of 12% takes 12 but a reference of 12 refuses 12%."""
    assert read_percent(math_verify, reading)(completion, answer, "").outcome is outcome


def test_a_reference_out_of_reach_itself_turns_the_screen_off():
    assert out_of_reach("\\boxed{100000!}", "100000!") is None
    assert out_of_reach("\\boxed{100000!}", "120") is not None


def test_the_answer_region_is_the_last_closed_box_else_the_text():
    assert answer_region("\\boxed{1} then \\boxed{\\frac{1}{2}} end") == ("\\frac{1}{2}", True)
    assert answer_region("\\boxed{\\frac{1}{2") == ("\\boxed{\\frac{1}{2", False)
    assert answer_region("x = 9^{9}") == ("x = 9^{9}", False)


def test_verdicts_carry_a_reward_in_0_1():
    assert (Verdict(Outcome.correct).reward, Verdict(Outcome.wrong).reward) == (1.0, 0.0)
    assert Verdict(Outcome.wrong, reward=0.25).reward == 0.25
    assert reward_of(Verdict(Outcome.correct, reward=0.5)) == 0.5
    assert (reward_of(Outcome.correct), reward_of(Outcome.timeout)) == (1.0, 0.0)
    for bad in (1.5, -0.1, math.nan):
        with pytest.raises(ValueError, match="outside"):
            Verdict(Outcome.correct, reward=bad)


@pytest.mark.slow
def test_pathological_answers_are_wrong_without_a_timeout_or_restart():
    """In the pool, as in a run: the screen answers, no process hits its time limit or restarts.
    The unbalanced box is not screened: math-verify reads it in milliseconds."""
    completions = [*PATHOLOGICAL, "\\boxed{\\frac{1}{2}", "\\boxed{47}"]
    with RewardPool("math", RewardsConfig(processes=2)) as pool:
        out = pool.score([Task(i, c, "47", "") for i, c in enumerate(completions)])
        assert out == [Outcome.wrong] * (len(completions) - 1) + [Outcome.correct]
        assert pool.restarts == 0


@pytest.mark.slow
def test_without_the_screen_a_tower_costs_a_timeout_and_a_restart(monkeypatch):
    """What the screen saves: the same tower through math-verify alone runs into the time limit."""
    monkeypatch.setenv("HPCRL_PLUGINS", "tests.harness.verifier_plugins")
    with RewardPool("test_unscreened", RewardsConfig(processes=1, timeout_s=1.0)) as pool:
        out = pool.score([Task(0, "\\boxed{9^{9^{9}}}", "47", ""), Task(1, "\\boxed{47}", "47", "")])
        assert out == [Outcome.timeout, Outcome.correct]
        assert pool.restarts == 1


@pytest.mark.slow
def test_submit_returns_while_tasks_run_and_drain_returns_each_once(monkeypatch, tmp_path):
    """Tasks submitted while others are held busy are all scored once; the verdicts are score()'s."""
    monkeypatch.setenv("HPCRL_PLUGINS", "tests.harness.verifier_plugins")
    gate = tmp_path / "go"
    with RewardPool("test_held", RewardsConfig(processes=2, timeout_s=60.0)) as pool:
        pool.submit([Task(i, str(gate), "ok" if i % 2 else "no", "") for i in range(3)])
        pool.submit([Task(i, str(gate), "ok" if i % 2 else "no", "") for i in range(3, 7)])  # 2 held
        with pytest.raises(ValueError, match=r"unique until drain\(\): \[4\]"):
            pool.submit([Task(4, str(gate), "ok", "")])
        with pytest.raises(RuntimeError, match="drain"):
            pool.score([Task(9, str(gate), "ok", "")])
        gate.touch()  # only now can a verifier finish: submit did not wait for one
        verdicts = pool.drain()
        assert sorted(verdicts) == list(range(7))
        assert [verdicts[i].outcome for i in range(7)] == [Outcome.wrong, Outcome.correct] * 3 + [
            Outcome.wrong
        ]
        assert pool.drain() == {}
        again = pool.score([Task(i, str(gate), "ok" if i % 2 else "no", "") for i in range(7)])
        assert again == [verdicts[i].outcome for i in range(7)]
        assert pool.restarts == 0


@pytest.mark.slow
def test_streamed_math_verdicts_equal_score(monkeypatch):
    tasks = [Task(i, c, a, "") for i, (c, a) in enumerate([*LEGIT, ("\\boxed{3}", "2"), ("x", "2")])]
    with RewardPool("math", RewardsConfig(processes=2)) as pool:
        scored = pool.score(tasks)
        for start in range(0, len(tasks), 5):
            pool.submit(tasks[start : start + 5])
        streamed = pool.drain()
    assert [streamed[t.index].outcome for t in tasks] == scored
    assert scored == [Outcome.correct] * len(LEGIT) + [Outcome.wrong, Outcome.parse_error]


@pytest.mark.slow
def test_partial_credit_from_a_plugin_verifier_reaches_reward_of(monkeypatch):
    monkeypatch.setenv("HPCRL_PLUGINS", "tests.harness.verifier_plugins")
    with RewardPool("test_partial", RewardsConfig(processes=1)) as pool:
        pool.submit([Task(i, c, "", "") for i, c in enumerate(["0.25", "1.0", "0", "1.5", "not a verdict"])])
        verdicts = pool.drain()
    assert [reward_of(verdicts[i]) for i in range(5)] == [0.25, 1.0, 0.0, 0.0, 0.0]
    assert [verdicts[i].outcome for i in range(5)] == [
        Outcome.wrong,
        Outcome.correct,
        Outcome.wrong,
        Outcome.error,  # a reward outside [0, 1]
        Outcome.error,  # not a Verdict
    ]
    assert pool.restarts == 0
