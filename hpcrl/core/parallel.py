"""The parallel degrees, one record each side: how training splits over its GPUs (``TrainParallel``) and
how generation splits into engines (``RolloutParallel``).

The plan builds them from the config (``plan/topology.py``'s ``Topology`` holds both), the memory model
and the layout search read and choose them, and each trainer rank receives the plan's ``TrainParallel``
(``run/fleet.py``): no layer below rebuilds them from ``trainer.*``. Each validates itself on
construction; world sizes are derived, never configured.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcrl.core.checks import divisors
from hpcrl.errors import ConfigError


@dataclass(frozen=True)
class TrainParallel:
    """Training parallelism over ``world`` GPUs: world = dp x cp x pp x tp; ep splits experts."""

    world: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    expert_tp: int = 1

    def __post_init__(self) -> None:
        model_parallel = self.tp * self.pp * self.cp
        if self.world % model_parallel:
            options = ", ".join(str(d) for d in divisors(self.world))
            raise ConfigError(
                f"trainer.tp={self.tp} x trainer.pp={self.pp} x trainer.cp={self.cp} = {model_parallel} "
                f"does not divide the {self.world} training GPUs; each product must be one of {options}"
            )
        expert_group = self.ep * self.expert_tp
        if (self.world // self.pp) % expert_group:
            raise ConfigError(
                f"trainer.ep={self.ep} x trainer.expert_tp={self.expert_tp} must divide the "
                f"{self.world // self.pp} GPUs of one pipeline stage (training GPUs / trainer.pp)"
            )

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp * self.cp)

    @property
    def expert_dp(self) -> int:
        """Replicas of each expert shard (what the distributed optimizer shards expert state over)."""
        return self.world // (self.pp * self.ep * self.expert_tp)


@dataclass(frozen=True)
class RolloutParallel:
    """Rollout parallelism: ``engines`` independent inference engines of ``tp`` GPUs each, or with
    ``per_gpu`` > 1 (tp 1 only) that many engines sharing each GPU."""

    gpus: int
    tp: int = 1
    per_gpu: int = 1

    def __post_init__(self) -> None:
        if self.per_gpu > 1 and self.tp > 1:
            raise ConfigError(
                f"rollout.engines_per_gpu={self.per_gpu} needs rollout.tp=1 (got {self.tp}): "
                "engines share a GPU only when each fits on one"
            )
        if self.gpus % self.tp:
            raise ConfigError(
                f"rollout.tp={self.tp} does not divide the {self.gpus} rollout GPUs; "
                f"choose one of {', '.join(str(d) for d in divisors(self.gpus))}"
            )

    @property
    def engines(self) -> int:
        return self.gpus // self.tp * self.per_gpu
