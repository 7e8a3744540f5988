"""The environment interface and its registry.

An environment plays one episode: ``reset(prompt, answer)`` returns its first observation (often ""),
then ``step(turn)`` takes each model turn's text and returns a ``Step``: what the model reads next,
the reward so far, whether the episode is over. The episode runner (``envs/episodes.py``) trains on the
model's tokens only; an environment's observations go into the context, loss-masked.

Register one with ``@register_env("name")`` on a factory ``(EnvSpec) -> Environment`` and select it
with ``env.name=name`` (``HPCRL_PLUGINS=my.module`` imports the module, as for verifiers). Each episode
gets a fresh instance in a process of its own (``envs/pool.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from hpcrl.envs.config import ENV_NAMES
from hpcrl.envs.toolcall import ToolCall, ToolCallError, parse_tool_calls


@dataclass(frozen=True)
class Step:
    observation: str
    """Text the model reads before its next turn (a tool's result, an error); "" for none."""
    reward: float = 0.0
    """In [0, 1]; the episode's reward is its last step's."""
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    """Free-form; ``info["outcome"]`` (a ``rewards.verifiers.Outcome`` value) says how the run counts
    the episode (correct, wrong, parse_error); left out: correct at reward 1, else wrong."""


class Environment(Protocol):
    def reset(self, prompt: str, answer: str) -> str:
        """Start an episode on a problem (its prompt text and reference answer); the first observation."""
        ...

    def step(self, turn: str) -> Step:
        """The model's turn (decoded text, special tokens left out); what follows."""
        ...


@dataclass(frozen=True)
class EnvSpec:
    """What a factory builds an environment from."""

    argument: str
    """The text after ``env.name``'s colon ("" when none)."""
    tool_format: str
    """``env.tool_format``: how the model writes tool calls (``envs/toolcall.py``)."""
    verifier: str
    """``data.verifier``: the checker of a final answer, for environments that grade with it."""


Factory = Callable[[EnvSpec], Environment]
REGISTRY: dict[str, Factory] = {}


def register_env(name: str) -> Callable[[Factory], Factory]:
    def wrap(factory: Factory) -> Factory:
        REGISTRY[name] = factory
        ENV_NAMES.add(name)  # what the config's check reads (envs/config.py)
        return factory

    return wrap


def tool_calls(turn: str, fmt: str) -> list[ToolCall] | Step:
    """The tool calls in a model turn, or the error turn the model reads when they do not parse (a
    malformed call costs a turn, never the episode)."""
    try:
        return parse_tool_calls(turn, fmt)
    except ToolCallError as exc:
        return Step(f"error: {exc}", info={"tool_error": True})
