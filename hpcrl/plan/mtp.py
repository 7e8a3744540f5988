"""The planner's checks of the multi-token-prediction settings: the trainer carrying a model's MTP
layers (``trainer.mtp_loss_scale``) and the engine drafting with them (``rollout.speculative``)."""

from __future__ import annotations

from hpcrl.config.schema import RunConfig
from hpcrl.errors import ConfigError
from hpcrl.rollout.backends import speculative
from hpcrl.trainer.backends import trainer_spec, with_mtp


def check_mtp(cfg: RunConfig) -> None:
    """MTP settings need a model with MTP layers, a backend that carries them, and (to draft) a
    trainer that refits them."""
    scale, model = cfg.trainer.mtp_loss_scale, cfg.model
    if scale is not None and not model.mtp_layers:
        raise ConfigError(
            f"trainer.mtp_loss_scale={scale}: {model.name} has no MTP layers (model.mtp_layers=0); "
            "drop trainer.mtp_loss_scale"
        )
    gap = trainer_spec(cfg.trainer).mtp_gap
    if scale is not None and gap is None:
        raise ConfigError(
            f"trainer.mtp_loss_scale={scale}: the {cfg.trainer.backend} backend does not carry MTP layers "
            f"yet; use {with_mtp()} or drop trainer.mtp_loss_scale"
        )
    if scale is not None and gap is not None and (why := gap(model, cfg.trainer)):
        raise ConfigError(f"trainer.mtp_loss_scale={scale}: {why}")
    method = speculative(cfg.rollout)
    if method is None:
        return
    if not model.mtp_layers:
        raise ConfigError(
            f"rollout.speculative={method} drafts with the model's MTP layers; {model.name} has none "
            "(model.mtp_layers=0): set rollout.speculative=null"
        )
    if scale is None:
        raise ConfigError(
            f"rollout.speculative={method} drafts with MTP layers the trainer leaves out, so no refit would "
            "reach them: set trainer.mtp_loss_scale (0.3: NeMo RL's Super recipe; 0: carried, untrained)"
        )
