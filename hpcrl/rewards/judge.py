"""An LLM judge's reward (``rewards.judge``): the step's samples go to the judge in one batch once the
verifier has scored them; each reply is parsed into a score in [0, 1], which joins the verifier's reward
by ``rewards.judge.weight``. The judge's engines are run/judges.py's (a frozen model, never refit); here
is what does not need them: the prompt, the parse, the mix, and the scorer the loop talks to.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

from hpcrl.rewards.config import JudgeConfig
from hpcrl.rewards.pool import Task
from hpcrl.rewards.verifiers import Verdict

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def judge_prompt(template: str, task: Task) -> str:
    """``rewards.judge.template`` filled in for one sample."""
    return template.format(prompt=task.prompt, answer=task.completion, reference=task.answer)


def parse_score(reply: str, how: str, scale: float) -> float | None:
    """The judge's ``reply`` as a score in [0, 1]; None: it says nothing ``how`` can read."""
    if how == "yes_no":
        word = reply.strip().lower()
        return 1.0 if word.startswith("yes") else 0.0 if word.startswith("no") else None
    found = _NUMBER.search(reply)
    if found is None:
        return None
    return min(1.0, max(0.0, float(found.group()) / scale))


def mixed(verdict: Verdict, score: float, weight: float) -> Verdict:
    """The verifier's verdict with the judge's ``score`` mixed into its reward (its outcome stays: the
    run's accuracy is still the verifier's)."""
    return replace(verdict, reward=(1.0 - weight) * verdict.reward + weight * score)


class Verifiers(Protocol):
    """The reward pool as the judge's scorer uses it (``RewardPool``)."""

    def submit(self, tasks: list[Task]) -> None: ...
    def drain(self) -> dict[int, Verdict]: ...


Judge = Callable[[list[str]], list[str]]
"""Judge prompts in, one reply each out, in order (run/judges.py's ``JudgeGroup.replies``)."""


@dataclass
class JudgedScorer:
    """The loop's scorer (``loop.Scorer``) with a judge behind the verifiers: ``submit`` hands the tasks
    to the reward pool as they come; ``drain`` takes the pool's verdicts, then judges every sample
    submitted since the last drain in one batch and mixes the scores in."""

    pool: Verifiers
    judge: Judge
    settings: JudgeConfig
    tasks: list[Task] = field(default_factory=list)
    figures: dict[str, float] = field(default_factory=dict)
    """Since the last ``stats()``: seconds judging, samples, unparsable replies, the score sum."""

    def submit(self, tasks: list[Task]) -> None:
        self.pool.submit(tasks)
        self.tasks += tasks

    def drain(self) -> dict[int, Verdict]:
        verdicts = self.pool.drain()
        tasks, self.tasks = self.tasks, []
        if not tasks:
            return verdicts
        start = time.perf_counter()
        replies = self.judge([judge_prompt(self.settings.template, t) for t in tasks])
        if len(replies) != len(tasks):
            raise RuntimeError(f"internal: the judges gave {len(replies)} replies to {len(tasks)} prompts")
        s = self.settings
        scores = [parse_score(r, s.parse, s.scale) for r in replies]
        for t, score in zip(tasks, scores, strict=True):
            verdicts[t.index] = mixed(verdicts[t.index], score or 0.0, s.weight)
        self._count(time.perf_counter() - start, scores)
        return verdicts

    def _count(self, seconds: float, scores: list[float | None]) -> None:
        add = {
            "time/judge": seconds,
            "judge/batches": 1.0,
            "judge/samples": float(len(scores)),
            "judge/parse_failures": float(sum(s is None for s in scores)),
            "judge/score_sum": sum(s or 0.0 for s in scores),
        }
        for key, value in add.items():
            self.figures[key] = self.figures.get(key, 0.0) + value

    def stats(self) -> dict[str, float]:
        """The judge's figures since the last call (then reset): ``time/judge``, ``judge/batches``, ``judge/samples``,
        ``judge/parse_failures``, ``judge/mean_score``."""
        f, self.figures = self.figures, {}
        if not f:
            return {}
        mean = f.pop("judge/score_sum") / max(1.0, f["judge/samples"])
        return {**f, "judge/mean_score": mean}
