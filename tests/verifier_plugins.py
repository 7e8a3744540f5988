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
