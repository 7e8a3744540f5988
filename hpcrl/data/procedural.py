"""Procedural data from reasoning-gym (``data.source=reasoning_gym:<task>``): problems generated from the
run's seed, no download, scored by the task's own checker.

Training problems come from ``run.seed``, validation problems from a seed ``VAL_SEED_OFFSET`` away, and
a training problem whose prompt is also a validation prompt is skipped: the two sets are disjoint and
the same on every run. ``data.task_options`` are the task's own config fields (reasoning-gym's
``<Task>Config``: ``min_terms``, ``max_digits``, ...), checked against them before anything runs.
``data.prompt_field`` picks the entry's field the prompt is made of: ``question``, or a field of its
metadata (``metadata.expression``: the bare sum, as NeMo RL's reasoning-gym loader builds prompts of
its own from the metadata for some tasks).

Each example's answer is the task's entry (question, oracle answer, metadata) with the task's name and
options, JSON-encoded (``encode_answer``): it travels with the sample to the reward processes, where
``data.verifier=reasoning_gym`` (``hpcrl/rewards/verifiers.py``) scores with the task's
``score_answer``. reasoning-gym is imported inside the functions: ``hpcrl plan`` never needs it.
"""

from __future__ import annotations

import dataclasses
import json
from functools import cache
from typing import Any

from hpcrl.data.config import PREFIX, check_task_options, entry_field, gym, task_of
from hpcrl.errors import ConfigError

VAL_SEED_OFFSET = 10_000_019
"""Validation is generated from ``run.seed + VAL_SEED_OFFSET``: reasoning-gym derives problem ``i`` from
``seed + i``, so the two seed ranges do not meet (the prompt filter holds them apart regardless)."""
MAX_DRAWS = 8
"""Problems drawn per problem kept, at most, before a task is found too small for the sizes asked."""
_TAGS = ("__tuple__", "__set__", "__items__")


def generate(
    source: str, options: dict[str, Any], prompt_field: str, num_train: int, num_val: int, seed: int
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(problem, encoded answer) pairs, the problem being the entry's ``prompt_field``: ``num_train``
    training problems from ``seed`` and ``num_val`` distinct validation problems from
    ``seed + VAL_SEED_OFFSET``, no problem in both."""
    task = task_of(source)
    check_task_options(task, options, prompt_field)
    draw = Draw(task, options, prompt_field)
    val = draw(seed + VAL_SEED_OFFSET, num_val, exclude=set(), distinct=True)
    train = draw(seed, num_train, exclude={problem for problem, _ in val}, distinct=False)
    return train, val


@dataclasses.dataclass(frozen=True)
class Draw:
    task: str
    options: dict[str, Any]
    prompt_field: str

    def __call__(self, seed: int, count: int, exclude: set[str], distinct: bool) -> list[tuple[str, str]]:
        draws = count * MAX_DRAWS
        dataset = gym().create_dataset(self.task, seed=seed, size=draws, **self.options)
        out: list[tuple[str, str]] = []
        seen = set(exclude)
        for i in range(draws):
            entry = dataset[i]
            problem = entry_field(entry, self.prompt_field) or ""
            if problem in seen:
                continue
            if distinct:
                seen.add(problem)
            out.append((problem, encode_answer(self.task, self.options, entry)))
            if len(out) == count:
                return out
        kind = "distinct validation" if distinct else "training"
        raise ConfigError(
            f"{PREFIX}{self.task} with data.task_options={self.options} gave {len(out)} {kind} problems of "
            f"the {count} asked in {draws} draws: too few distinct problems; widen data.task_options or "
            "lower data.max_val_samples / data.num_samples"
        )


def encode_answer(task: str, options: dict[str, Any], entry: dict[str, Any]) -> str:
    try:
        return json.dumps({"task": task, "options": options, "entry": _pack(entry)})
    except TypeError as exc:
        raise ConfigError(
            f"reasoning-gym's {task} made an entry hpcrl cannot carry to its verifier: {exc}"
        ) from None


def decode_answer(answer: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(task, options, entry) of an ``encode_answer`` string."""
    data = json.loads(answer, object_hook=_unpack)
    return data["task"], data["options"], data["entry"]


def _pack(x: Any) -> Any:
    """JSON that decodes to ``x`` itself: tuples, sets and dicts with other than str keys are tagged
    (tasks' metadata holds them, and their ``score_answer`` compares with them)."""
    if isinstance(x, tuple):
        return {"__tuple__": [_pack(v) for v in x]}
    if isinstance(x, set | frozenset):
        return {"__set__": [_pack(v) for v in x]}
    if isinstance(x, list):
        return [_pack(v) for v in x]
    if isinstance(x, dict):
        if all(isinstance(k, str) for k in x) and not (len(x) == 1 and next(iter(x)) in _TAGS):
            return {k: _pack(v) for k, v in x.items()}
        return {"__items__": [[_pack(k), _pack(v)] for k, v in x.items()]}
    return x


def _unpack(d: dict[str, Any]) -> Any:
    if len(d) == 1 and (tag := next(iter(d))) in _TAGS:
        value = d[tag]
        if tag == "__tuple__":
            return tuple(value)
        if tag == "__set__":
            return set(value)
        return {_hashable(k): v for k, v in value}
    return d


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def score(completion: str, answer: str) -> float | None:
    """The task's ``score_answer`` of the completion's final answer; None when there is nothing to score.

    The final answer is the last ``<answer>...</answer>`` (what reasoning-gym's prompts ask for), scored
    as the task scores it, partial credit included. A completion without tags (a model prompted with
    the bare question) is its answer as a whole, and only a full score counts: the tasks' partial credit
    is a substring match (``len(oracle) / len(text)`` for any text holding the oracle), which on raw text
    pays for rambling: "<answer>7</answer>" after reasoning would get 1/40, "3 7 9" a third."""
    rg = gym()  # first: the reward pool's warm-up call (no entry) imports the package before it is timed
    task, options, entry = decode_answer(answer)
    tagged = rg.utils.extract_answer(completion)
    final = (completion if tagged is None else tagged).strip()
    if not final:
        return None
    reward = float(_scorer(task, json.dumps(options, sort_keys=True)).score_answer(final, entry))
    return reward if tagged is not None or reward == 1.0 else 0.0


@cache
def _scorer(task: str, options: str) -> Any:
    """One dataset object per task and options in a reward process (some load word lists or grids)."""
    return gym().create_dataset(task, seed=0, size=1, **json.loads(options))
