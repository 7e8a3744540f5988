"""Environment schema (``env.*``): which environment drives multi-turn episodes and their limits.

``env.name`` empty (the default) keeps the single-turn rollouts: one completion per sample, scored by
``data.verifier``. A name picks a registered environment (``hpcrl/envs/base.py``; built-in ones in
``hpcrl/envs/builtin.py``, more from plugin modules named in ``HPCRL_PLUGINS``), with an argument after
a colon where the environment takes one (``nemo_gym:http://host:port``). The names live here, so that
the config layer checks ``env.name`` without importing the environments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hpcrl.core.checks import one_of, positive
from hpcrl.errors import ConfigError

BUILT_IN_ENVS = ("python", "calculator", "nemo_gym")
"""The environments ``envs/builtin.py`` and ``envs/nemo_gym.py`` register (tests/envs hold them equal)."""
ENV_NAMES: set[str] = set(BUILT_IN_ENVS)
"""Every environment this process knows: the built-in ones and those plugins registered."""
TOOL_FORMATS = ("hermes", "nemotron")
"""How a model writes a tool call (``envs/toolcall.py``): Qwen/Hermes ``<tool_call>{json}</tool_call>``,
Llama-Nemotron ``<TOOLCALL>[{json}, ...]</TOOLCALL>``."""


@dataclass
class EnvConfig:
    name: str = ""
    """The environment (``<name>`` or ``<name>:<argument>``); empty: single-turn rollouts."""
    max_turns: int = 4
    """Model turns per episode: the episode ends after this many even if the environment would go on."""
    max_tokens: int = 512
    """Tokens after the prompt per episode, model and environment turns together; each model turn
    generates at most ``rollout.max_new_tokens`` and never past this budget."""
    tool_format: str = "hermes"
    """How the model writes tool calls (one of ``TOOL_FORMATS``)."""
    processes: int = 16
    """Episodes running at once, each environment in a process of its own (more wait their turn)."""
    step_timeout_s: float = 30.0
    """An environment's reset or step still busy after this long is killed: its episode ends with an
    error (reward 0), the other episodes and the step go on."""
    memory_mb: int = 2048
    """Address-space limit of each environment process (``RLIMIT_AS``): one that allocates past it
    fails its episode, not the node."""

    @property
    def enabled(self) -> bool:
        return bool(self.name)

    def kind(self) -> str:
        """The registered name (before any ``:argument``)."""
        return self.name.partition(":")[0]

    def check(self) -> None:
        if not self.enabled:
            return
        if self.kind() not in ENV_NAMES:
            raise ConfigError(
                f"env.name={self.name}: unknown environment {self.kind()!r}; registered: "
                f"{', '.join(sorted(ENV_NAMES))} (a plugin's module goes in HPCRL_PLUGINS)"
            )
        one_of("env.tool_format", self.tool_format, TOOL_FORMATS)
        for key, value in (
            ("env.max_turns", self.max_turns),
            ("env.max_tokens", self.max_tokens),
            ("env.processes", self.processes),
            ("env.memory_mb", self.memory_mb),
            ("env.step_timeout_s", self.step_timeout_s),
        ):
            positive(key, value)
        if not math.isfinite(self.step_timeout_s):
            raise ConfigError(f"env.step_timeout_s={self.step_timeout_s} must be a finite number of seconds")
