"""The planner's checks of settings only MoE models have."""

from __future__ import annotations

from hpcrl.config.schema import RunConfig
from hpcrl.errors import ConfigError
from hpcrl.rollout.backends import rollout_spec, with_routes


def check_router_replay(cfg: RunConfig) -> None:
    """``trainer.router_replay``: an MoE model, an engine that returns routes, whole sequences per rank."""
    trainer, model = cfg.trainer, cfg.model
    if not trainer.router_replay:
        return
    if not model.is_moe:
        raise ConfigError(
            f"trainer.router_replay=true needs an MoE model; {model.name} is dense (set trainer.router_replay=false)"
        )
    if not rollout_spec(cfg.rollout).routes:
        raise ConfigError(
            f"trainer.router_replay=true: the {cfg.rollout.backend} engine does not return the experts it "
            f"routed to; use {with_routes()} or trainer.router_replay=false"
        )
    if trainer.cp > 1:
        raise ConfigError(
            f"trainer.router_replay=true with trainer.cp={trainer.cp}: routes are not split over context "
            "parallel ranks yet; set trainer.cp=1 or trainer.router_replay=false"
        )
