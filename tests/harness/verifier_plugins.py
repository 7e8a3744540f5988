"""Verifiers that misbehave on purpose, loaded into reward processes through HPCRL_PLUGINS."""

from __future__ import annotations

import os

from hpcrl.rewards.verifiers import Outcome, Verdict, register


@register("test_adversarial")
def adversarial(completion: str, answer: str, prompt: str = "") -> Verdict:
    if completion == "hang":
        while True:  # a verifier stuck forever (e.g. SymPy on a pathological expression)
            pass
    if completion == "crash":
        os._exit(3)  # the worker process dies
    if completion == "raise":
        raise ValueError("broken verifier")
    if completion == "eat":
        hog = []
        while True:  # a verifier eating memory until something stops it (rewards.memory_mb)
            hog.append(bytearray(64 << 20))
    return Verdict(Outcome.correct if completion == answer else Outcome.wrong)


_first_call = [True]


@register("test_slow_first_call")
def slow_first_call(completion: str, answer: str, prompt: str = "") -> Verdict:
    """Like math-verify: the first call in a process builds its parsers (here: sleeps 2 s)."""
    if _first_call[0]:
        _first_call[0] = False
        import time

        time.sleep(2.0)
    return Verdict(Outcome.correct if completion == answer else Outcome.wrong)


@register("test_held")
def held(completion: str, answer: str, prompt: str = "") -> Verdict:
    """Busy until the file named by the completion exists: the test decides when scoring may finish.
    (The pool's warm-up call, before the process says ready, returns at once.)"""
    import time
    from pathlib import Path

    if not completion.startswith("/"):
        return Verdict(Outcome.parse_error)
    while not Path(completion).exists():
        time.sleep(0.01)
    return Verdict(Outcome.correct if answer == "ok" else Outcome.wrong)


@register("test_partial")
def partial(completion: str, answer: str, prompt: str = "") -> Verdict:
    """Partial credit: the completion is the reward; out of [0, 1] it is a broken verifier."""
    if completion == "not a verdict":
        return 0.5  # type: ignore[return-value]
    reward = float(completion)
    return Verdict(Outcome.correct if reward == 1.0 else Outcome.wrong, reward=reward)


@register("test_unscreened")
def unscreened(completion: str, answer: str, prompt: str = "") -> Verdict:
    """math-verify without the screen, as the "math" verifier was before it."""
    from hpcrl.rewards.verifiers import sympy_verify

    return sympy_verify(completion, answer)
