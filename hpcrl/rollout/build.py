"""The engine ``rollout`` names, built in this process: the rollout actors and ``hpcrl eval`` share it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from hpcrl.rollout.backends import rollout_spec
from hpcrl.rollout.config import RolloutConfig

if TYPE_CHECKING:
    from hpcrl.rollout.base import RolloutEngine


def build_engine(
    model_dir: Path,
    rollout: RolloutConfig,
    *,
    seed: int,
    max_model_len: int,
    on_cpu: bool,
    scratch: Path,
    kv_cache_gb: float | None,
    routes: bool = False,
) -> RolloutEngine:
    """The engine the rollout group chose, started through its class's ``start`` (``kv_cache_gb``:
    where the spec's ``cpu_kv_budget`` asks for it; ``routes``: its completions carry the experts
    routed to, ``trainer.router_replay``, on an engine whose spec has ``routes``)."""
    engine: RolloutEngine = (
        rollout_spec(rollout)
        .make()
        .start(
            model_dir,
            rollout,
            seed=seed,
            max_model_len=max_model_len,
            on_cpu=on_cpu,
            scratch=scratch,
            kv_cache_gb=kv_cache_gb,
            routes=routes,
        )
    )
    return engine
