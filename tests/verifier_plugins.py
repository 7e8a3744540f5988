"""Verifiers that misbehave on purpose, loaded into reward workers through HPCRL_PLUGINS."""

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
