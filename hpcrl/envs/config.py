"""Environment schema (``env.*``): which environment drives multi-turn episodes and their limits.

``env.name`` empty (the default) keeps the single-turn rollouts: one completion per sample, scored by
``data.verifier``. A name picks a registered environment (``hpcrl/envs/base.py``; built-in ones in
``hpcrl/envs/builtin.py``, more from plugin modules named in ``HPCRL_PLUGINS``), with an argument after
a colon where the environment takes one (``nemo_gym:http://host:port``,
``verifiers:<module>:<factory>``). The names live here, so that
the config layer checks ``env.name`` without importing the environments.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from hpcrl.core.checks import one_of, positive
from hpcrl.errors import ConfigError
from hpcrl.rewards.config import load_plugins

BUILT_IN_ENVS = ("python", "calculator", "nemo_gym", "verifiers")
"""The environments ``envs/builtin.py``, ``envs/nemo_gym.py`` and ``envs/verifiers_env.py`` register (tests/envs hold them equal)."""
ENV_NAMES: set[str] = set(BUILT_IN_ENVS)
"""Every environment this process knows: the built-in ones and those plugins registered."""
ENV_RESOURCE = "hpcrl_env"
"""The Ray resource the environment nodes (``env.nodes``) advertise, one unit a node: an environment
actor each (``envs/remote.py``)."""
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
    processes: int = 64
    """Episodes running at once, each environment in a process of its own (more wait their turn). It
    also bounds each engine call (one turn of the running episodes): fewer starve the engine's batch,
    more cost ~50 MB of resident memory each on the driver's node."""
    step_timeout_s: float = 30.0
    """An environment's reset or step still busy after this long is killed: its episode ends with an
    error (reward 0), the other episodes and the step go on."""
    memory_mb: int = 2048
    """Address-space limit of each environment process (``RLIMIT_AS``): one that allocates past it
    fails its episode, not the node."""
    nodes: int = 0
    """Nodes of the environments' own (a Slurm job's role, ``env`` in ``hpcrl plan``): the episodes'
    environment processes run in a Ray actor on each (``env.processes`` in all, spread over them), not on
    the driver's node. ``cluster.env_node`` makes them a zero-GPU component of a heterogeneous job;
    without it they are more nodes of the training nodes' kind. 0: beside the driver."""

    @property
    def enabled(self) -> bool:
        return bool(self.name)

    def kind(self) -> str:
        """The registered name (before any ``:argument``)."""
        return self.name.partition(":")[0]

    def check(self) -> None:
        if self.nodes < 0:
            raise ConfigError(
                f"env.nodes={self.nodes} must be >= 0 (0: the environments run beside the driver)"
            )
        if not self.enabled:
            if self.nodes:
                raise ConfigError(
                    f"env.nodes={self.nodes} gives environments nodes of their own, and env.name is empty "
                    "(single-turn rollouts): set env.name=<environment> or env.nodes=0"
                )
            return
        self._check_name()
        one_of("env.tool_format", self.tool_format, TOOL_FORMATS)
        for key, value in (
            ("env.max_turns", self.max_turns),
            ("env.max_tokens", self.max_tokens),
            ("env.processes", self.processes),
            ("env.memory_mb", self.memory_mb),
            ("env.step_timeout_s", self.step_timeout_s),
        ):
            positive(key, value)
        if not math.isfinite(self.step_timeout_s):  # inf would turn the hard limit off
            raise ConfigError(f"env.step_timeout_s={self.step_timeout_s} must be a finite number of seconds")

    def check_episodes(self, router_replay: bool, image_field: str | None, overlong_buffer: int) -> None:
        """What multi-turn episodes do not carry yet: refused here rather than dropped in the job."""
        if self.enabled and router_replay:
            raise ConfigError(
                f"env.name={self.name}: episodes do not record the engine's routes across turns; "
                "set trainer.router_replay=false"
            )
        if self.enabled and overlong_buffer:  # it measures a completion against rollout.max_new_tokens
            raise ConfigError(
                f"env.name={self.name}: algo.overlong_buffer={overlong_buffer} would measure whole episodes "
                "(model and environment tokens) against one turn's rollout.max_new_tokens; set it to 0"
            )
        if self.enabled and image_field:
            raise ConfigError(f"env.name={self.name}: episodes take text prompts; drop data.image_field")

    def check_nodes(self, scheduler: str, node_kind: bool) -> None:
        """``env.nodes`` against the cluster: a Slurm or KubeRay job's role; ``cluster.env_node`` needs them."""
        if self.nodes and scheduler == "local":
            raise ConfigError(
                f"env.nodes={self.nodes}: a local run has one machine, where the environments run beside "
                "the engines: set env.nodes=0"
            )
        if node_kind and not self.nodes:
            raise ConfigError(
                "cluster.env_node describes environment nodes, and this run has none: set env.nodes >= 1 "
                "(with env.name), or remove cluster.env_node"
            )

    def _check_name(self) -> None:
        """Built in, or registered by a module of ``HPCRL_PLUGINS``, imported here as the job will."""
        if self.kind() in ENV_NAMES:
            return
        plugins = os.environ.get("HPCRL_PLUGINS", "")
        try:
            load_plugins(plugins)
        except Exception as exc:  # a broken plugin fails here, not in every episode of the job
            raise ConfigError(
                f"env.name={self.name}: HPCRL_PLUGINS={plugins} does not import here "
                f"({type(exc).__name__}: {exc}); fix the module or its PYTHONPATH"
            ) from None
        if self.kind() not in ENV_NAMES:
            raise ConfigError(
                f"env.name={self.name} is not an environment; use one of: {', '.join(sorted(ENV_NAMES))}, "
                f"or register yours with @register_env('{self.kind()}') in a module named by HPCRL_PLUGINS"
            )
