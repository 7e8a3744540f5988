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

from hpcrl.errors import ConfigError

PREFIX = "reasoning_gym:"
VAL_SEED_OFFSET = 10_000_019
"""Validation is generated from ``run.seed + VAL_SEED_OFFSET``: reasoning-gym derives problem ``i`` from
``seed + i``, so the two seed ranges do not meet (the prompt filter holds them apart regardless)."""
MAX_DRAWS = 8
"""Problems drawn per problem kept, at most, before a task is found too small for the sizes asked."""
SET_BY_HPCRL = {"seed": "run.seed", "size": "data.num_samples / data.max_val_samples"}
_TAGS = ("__tuple__", "__set__", "__items__")


def is_procedural(source: str) -> bool:
    return source.startswith(PREFIX)


def task_of(source: str) -> str:
    return source[len(PREFIX) :]


def _gym() -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise ConfigError(
            "data.source=reasoning_gym:... needs the reasoning-gym package (pip install reasoning-gym==0.1.25; "
            "hpcrl's cpu and gpu extras have it)"
        ) from None
    return reasoning_gym


def check_task(task: str, options: dict[str, Any], prompt_field: str) -> None:
    """An unknown task, an unknown option, one the task's own config refuses, or a prompt field its
    entries lack: one ConfigError line. Skipped where reasoning-gym is not installed (a login node with
    hpcrl's light dependencies): the job checks the same when it generates the problems."""
    try:
        import reasoning_gym  # noqa: F401
    except ImportError:
        return
    _check(task, options, prompt_field)


def _check(task: str, options: dict[str, Any], prompt_field: str) -> None:
    datasets = _gym().factory.DATASETS
    if task not in datasets:
        raise ConfigError(
            f"data.source={PREFIX}{task} is not a reasoning-gym task; use one of: {', '.join(sorted(datasets))}"
        )
    fields = sorted(f.name for f in dataclasses.fields(datasets[task][1]) if f.name not in SET_BY_HPCRL)
    for name in options:
        if name in SET_BY_HPCRL:
            raise ConfigError(f"data.task_options.{name} is set by hpcrl from {SET_BY_HPCRL[name]}; drop it")
        if name not in fields:
            raise ConfigError(
                f"data.task_options.{name} is not an option of reasoning-gym's {task}; its options: "
                f"{', '.join(fields)}"
            )
    try:
        entry = _gym().create_dataset(task, seed=0, size=1, **options)[0]
    except (AssertionError, ValueError, TypeError) as exc:  # the task config's own validate()
        raise ConfigError(
            f"data.task_options={options} is refused by reasoning-gym's {task}: {exc or type(exc).__name__}"
        ) from None
    if _field(entry, prompt_field) is None:
        names = ["question", *(f"metadata.{k}" for k in entry.get("metadata", {}))]
        raise ConfigError(
            f"data.prompt_field={prompt_field} is not a field of reasoning-gym's {task} entries; use one of: "
            f"{', '.join(names)}"
        )


def _field(entry: dict[str, Any], path: str) -> str | None:
    node: Any = entry
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return None if isinstance(node, dict | list) else str(node)


def generate(
    source: str, options: dict[str, Any], prompt_field: str, num_train: int, num_val: int, seed: int
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(problem, encoded answer) pairs, the problem being the entry's ``prompt_field``: ``num_train``
    training problems from ``seed`` and ``num_val`` distinct validation problems from
    ``seed + VAL_SEED_OFFSET``, no problem in both."""
    task = task_of(source)
    _check(task, options, prompt_field)
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
        dataset = _gym().create_dataset(self.task, seed=seed, size=draws, **self.options)
        out: list[tuple[str, str]] = []
        seen = set(exclude)
        for i in range(draws):
            entry = dataset[i]
            problem = _field(entry, self.prompt_field) or ""
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
    gym = _gym()  # first: the reward pool's warm-up call (no entry) imports the package before it is timed
    task, options, entry = decode_answer(answer)
    tagged = gym.utils.extract_answer(completion)
    final = (completion if tagged is None else tagged).strip()
    if not final:
        return None
    reward = float(_scorer(task, json.dumps(options, sort_keys=True)).score_answer(final, entry))
    return reward if tagged is not None or reward == 1.0 else 0.0


@cache
def _scorer(task: str, options: str) -> Any:
    """One dataset object per task and options in a reward process (some load word lists or grids)."""
    return _gym().create_dataset(task, seed=0, size=1, **json.loads(options))
