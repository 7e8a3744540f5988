"""A plugin that imports in the driver but not in a reward process (a package only the driver's
environment has, a path only its working directory sees)."""

from __future__ import annotations

import multiprocessing

from hpcrl.rewards.verifiers import Outcome, Verdict, register

if multiprocessing.parent_process() is not None:
    raise ImportError("No module named 'sympy_extras' (this node's environment lacks it)")


@register("test_no_start")
def no_start(completion: str, answer: str, prompt: str = "") -> Verdict:
    return Verdict(Outcome.correct)
