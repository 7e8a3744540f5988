"""Verifiers: ``fn(completion, answer, prompt) -> Verdict``. Register your own with ``@register("name")``
and select it with ``data.verifier=name`` (import your module with ``HPCRL_PLUGINS=my.module``).

A verdict is an outcome (what the run counts: accuracy, parse failures, timeouts) and a reward in
[0, 1] (what it trains on): 1.0 for ``correct`` and 0.0 otherwise unless the verifier gives partial
credit, e.g. ``Verdict(Outcome.wrong, reward=0.5)`` for a right method with a wrong final number.

Verifiers run inside the reward pool's processes, never in the training loop's process.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from hpcrl.rewards.config import VERIFIER_NAMES
from hpcrl.rewards.screen import out_of_reach


class Outcome(StrEnum):
    correct = "correct"
    wrong = "wrong"
    parse_error = "parse_error"  # nothing answer-like could be read from the completion
    timeout = "timeout"  # the verifier ran past its time limit (set by the pool)
    error = "error"  # the verifier raised (set by the pool)


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    reward: float = -1.0
    """In [0, 1]; left out: 1.0 when ``correct``, else 0.0. (-1 stands for "left out": a frozen
    dataclass cannot default one field from another.)"""

    def __post_init__(self) -> None:
        if self.reward == -1.0:
            object.__setattr__(self, "reward", 1.0 if self.outcome is Outcome.correct else 0.0)
        elif not 0.0 <= self.reward <= 1.0:  # also NaN
            raise ValueError(f"Verdict reward {self.reward!r} is outside [0, 1] ({self.outcome})")


def reward_of(verdict: Verdict | Outcome) -> float:
    """The reward the loop trains on: the verdict's, or the default of a bare outcome."""
    return (verdict if isinstance(verdict, Verdict) else Verdict(verdict)).reward


Verifier = Callable[[str, str, str], Verdict]
REGISTRY: dict[str, Verifier] = {}


def register(name: str) -> Callable[[Verifier], Verifier]:
    def wrap(fn: Verifier) -> Verifier:
        REGISTRY[name] = fn
        VERIFIER_NAMES.add(name)  # what the config's check reads (rewards/config.py)
        return fn

    return wrap


def get_verifier(name: str) -> Verifier:
    if name not in REGISTRY:
        raise KeyError(f"unknown verifier '{name}'; registered: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


_BOXED = re.compile(r"\\boxed\{")


@register("math")
def math_verify(completion: str, answer: str, prompt: str = "") -> Verdict:
    """HF math-verify: symbolic equivalence of the completion's final answer and the reference.

    Answers that would keep SymPy busy for seconds (``9^{9^{9}}``, ``100000!``, a 12-deep nest of
    braces) are scored ``wrong`` by a string screen first (``rewards/screen.py``), so they cost
    microseconds instead of a per-sample time limit and a process restart.
    """
    if out_of_reach(completion, answer) is not None:
        return Verdict(Outcome.wrong)
    return sympy_verify(completion, answer)


def sympy_verify(completion: str, answer: str) -> Verdict:
    """math-verify without the screen: whatever the answer, SymPy decides (or the pool's time limit).

    Timeouts inside math-verify use signal.alarm, which fails outside the main thread; they are
    turned off here and the pool enforces a hard per-sample limit instead.
    """
    from math_verify import parse, verify

    gold = parse(answer if _BOXED.search(answer) or not answer else f"${answer}$", parsing_timeout=None)
    pred = parse(completion, parsing_timeout=None)
    if not pred:
        return Verdict(Outcome.parse_error)
    ok = verify(gold, pred, timeout_seconds=None)
    return Verdict(Outcome.correct if ok else Outcome.wrong)


_PERCENT = re.compile(r"(\d+(?:\.\d+)?)\s*\\?%")


def read_percent(verify: Verifier, reading: str | None) -> Verifier:
    """``verify`` with the percent signs of the completion and the reference read as ``data.percent``
    says: dropped (``number``: 12\\% is 12) or written as a fraction (``fraction``: 12\\% is 12/100)."""
    if reading is None:
        return verify
    to = r"\1" if reading == "number" else r"\\frac{\1}{100}"

    def read(completion: str, answer: str, prompt: str = "") -> Verdict:
        return verify(_PERCENT.sub(to, completion), _PERCENT.sub(to, answer), prompt)

    return read


_FACTOR_PROMPT = re.compile(r"\bfactor", re.IGNORECASE)


@register("math_structural")
def math_verify_structural(completion: str, answer: str, prompt: str = "") -> Verdict:
    """math-verify plus a structural check: a 'factor ...' prompt answered with an expanded
    (unfactored) expression scores 0 even when SymPy finds it equal (seed 000, step 40)."""
    verdict = math_verify(completion, answer, prompt)
    if (
        verdict.outcome is Outcome.correct
        and _FACTOR_PROMPT.search(prompt)
        and not _looks_factored(completion)
    ):
        return Verdict(Outcome.wrong)
    return verdict


def _looks_factored(completion: str) -> bool:
    boxed = completion.rsplit("\\boxed{", 1)[-1]
    # a product of factors: parentheses multiplied together, or a power of a parenthesised term
    return bool(re.search(r"\)\s*(\^|\*|\()|\)\s*\\cdot|^\s*\d*\s*\(", boxed))


@register("exact")
def exact_match(completion: str, answer: str, prompt: str = "") -> Verdict:
    text = completion.strip()
    if not text:
        return Verdict(Outcome.parse_error)
    return Verdict(Outcome.correct if text == answer.strip() else Outcome.wrong)


@register("reasoning_gym")
def reasoning_gym_verify(completion: str, answer: str, prompt: str = "") -> Verdict:
    """reasoning-gym's own checker (the task's ``score_answer``) on the completion's final answer (the
    last ``<answer>...</answer>``, else the whole completion), for ``data.source=reasoning_gym:<task>``;
    ``answer`` carries the task's entry (``hpcrl/data/procedural.py``). Only a full score is ``correct``;
    the partial credit some tasks give a tagged answer is the reward of a ``wrong`` one."""
    from hpcrl.data.procedural import score

    reward = score(completion, answer)
    if reward is None:
        return Verdict(Outcome.parse_error)
    return Verdict(Outcome.correct if reward == 1.0 else Outcome.wrong, reward=reward)
