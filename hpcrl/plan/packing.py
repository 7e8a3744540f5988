"""``trainer.packing`` in the plan: where it can run, and the token budget it gets when unset."""

from __future__ import annotations

from hpcrl.config.schema import RunConfig
from hpcrl.errors import ConfigError
from hpcrl.trainer.backends import trainer_spec, with_capability


def check_packing(cfg: RunConfig) -> None:
    """``trainer.packing``: a backend that packs (over CP ranks too, where it can; Mamba layers restart
    at each sequence: ``trainer/ssd.py``)."""
    trainer = cfg.trainer
    if not trainer.packing:
        return
    if not trainer_spec(trainer).packs:
        raise ConfigError(
            f"trainer.packing=true: the {trainer.backend} backend does not pack sequences yet; "
            f"use {with_capability('packs')} or trainer.packing=false"
        )
    if trainer.cp > 1 and not trainer_spec(trainer).packs_over_cp:
        raise ConfigError(
            f"trainer.packing=true with trainer.cp={trainer.cp}: the {trainer.backend} backend does not "
            f"split packed rows over context parallel ranks; set trainer.cp=1, trainer.packing=false or "
            f"use {with_capability('packs_over_cp')}"
        )
    if cfg.data.image_field:
        raise ConfigError(
            f"trainer.packing=true with data.image_field={cfg.data.image_field}: image rows are not packed "
            "yet; set trainer.packing=false"
        )
    if trainer.micro_batch_tokens is not None and trainer.micro_batch_tokens < cfg.max_seq_len:
        raise ConfigError(
            f"trainer.micro_batch_tokens={trainer.micro_batch_tokens} is below the longest sequence "
            f"({cfg.max_seq_len} tokens), which must fit one micro-batch; raise it to at least {cfg.max_seq_len}"
        )


def resolve_packing(cfg: RunConfig) -> str:
    """Set ``trainer.micro_batch_tokens`` in place where packing leaves it None; the line ``hpcrl plan``
    prints for it, else ""."""
    trainer = cfg.trainer
    if not trainer.packing or trainer.micro_batch_tokens is not None:
        return ""
    trainer.micro_batch_tokens = trainer.micro_tokens(cfg.max_seq_len)
    return (
        f"trainer.micro_batch_tokens={trainer.micro_batch_tokens} (auto: trainer.micro_batch_size="
        f"{trainer.micro_batch_size} x the longest sequence, {cfg.max_seq_len}: the largest padded micro-batch's tokens)"
    )
