"""Model quirks: settings a model family needs and combinations it cannot run, applied automatically.

Each quirk is data (what to set, what to forbid, and why), so ``hpcrl plan`` can show exactly
what was changed. A user value that contradicts a required setting is an error, not overridden.
A setting applies where the chosen schema has its key: the vLLM engine's (``rollout.block_size``,
``rollout.load_format``, ``rollout.language_model_only``) pass over an engine without them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from hpcrl.config.model import ModelConfig
from hpcrl.config.schema import RunConfig
from hpcrl.errors import ConfigError


@dataclass(frozen=True)
class Setting:
    key: str
    """Dotted key under the run config, e.g. ``rollout.block_size``."""
    value: object
    reason: str
    strict: bool = True
    """Strict: a different explicit user value is an error. Otherwise lists are extended and flags set."""


@dataclass(frozen=True)
class Forbid:
    key: str
    is_bad: Callable[[object], bool]
    reason: str
    fix: str


@dataclass(frozen=True)
class Quirk:
    name: str
    applies: Callable[[RunConfig], bool]
    settings: Callable[[RunConfig], list[Setting]] = lambda cfg: []
    forbids: list[Forbid] = field(default_factory=list)


@dataclass(frozen=True)
class AppliedQuirk:
    quirk: str
    key: str
    value: object
    reason: str


def _family(*names: str) -> Callable[[RunConfig], bool]:
    return lambda cfg: cfg.model.family in names


def _gemma3_settings(cfg: RunConfig) -> list[Setting]:
    model: ModelConfig = cfg.model
    out = []
    if model.head_dim == 256:
        out.append(
            Setting(
                "rollout.block_size",
                32,
                "head_dim 256: vLLM's default 16-token KV block trips a FlashInfer assertion",
            )
        )
    out.append(
        Setting(
            "rollout.load_format",
            "auto",
            "vLLM's 'normalizer' buffer is not in the checkpoint, so a dummy load + refit leaves it wrong",
        )
    )
    out.append(
        Setting(
            "rollout.stop_token_ids",
            [106],
            "the chat template ends turns with <end_of_turn> (106), not <eos>",
            strict=False,
        )
    )
    if model.vlm:
        out.append(
            Setting(
                "trainer.freeze",
                ["vision_tower", "multi_modal_projector"],
                f"{model.hf_class} wraps the language model with a vision tower; RL trains the text path",
                strict=False,
            )
        )
    return out


def _gemma4_settings(cfg: RunConfig) -> list[Setting]:
    out = []
    if cfg.model.vlm and not cfg.data.image_field:
        out.append(
            Setting(
                "rollout.language_model_only",
                True,
                "text recipes run vLLM on the language model only",
                strict=False,
            )
        )
    if cfg.model.vlm:
        out.append(
            Setting(
                "trainer.freeze",
                ["vision_tower", "audio_tower", "embed_vision", "embed_audio"],
                "vision/audio towers stay frozen; refits skip them",
                strict=False,
            )
        )
    return out


def _moe_settings(cfg: RunConfig) -> list[Setting]:
    return [
        Setting(
            "trainer.router_dtype",
            "fp32",
            "router logits in high precision keep expert choice stable between rollout and training",
        ),
        Setting(
            "trainer.moe_aux_loss_coeff",
            0.0,
            "the load-balancing loss changes logprobs between rollout and training",
        ),
    ]


def _nemotron_h_settings(cfg: RunConfig) -> list[Setting]:
    out = [
        Setting(
            "trainer.freeze",
            ["e_score_correction_bias"],
            "the routers' fp32 correction bias only selects experts: RL keeps the checkpoint's "
            "values (no load-balancing updates) and refits leave it out",
            strict=False,
        )
    ]
    out.append(
        Setting(
            "rollout.load_format",
            "auto",
            "engines read the fp32 e_score_correction_bias from the checkpoint (refits, cast to "
            "the engine's dtype, leave it out), so a dummy load would leave it random",
        )
    )
    return out


QUIRKS: list[Quirk] = [
    Quirk("gemma3", _family("gemma3"), _gemma3_settings),
    Quirk("gemma4", _family("gemma4"), _gemma4_settings),
    Quirk("moe", lambda cfg: cfg.model.is_moe, _moe_settings),
    Quirk(
        "nemotron_h", lambda cfg: cfg.model.family == "nemotron_h" and cfg.model.is_moe, _nemotron_h_settings
    ),
]


def _get(cfg: RunConfig, key: str) -> object:
    node: object = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _set(cfg: RunConfig, key: str, value: object) -> None:
    parent_key, _, leaf = key.rpartition(".")
    setattr(_get(cfg, parent_key), leaf, value)


def apply_quirks(cfg: RunConfig) -> list[AppliedQuirk]:
    """Apply every matching quirk to ``cfg`` in place; return what was set, raise on forbidden values."""
    applied: list[AppliedQuirk] = []
    for quirk in QUIRKS:
        if not quirk.applies(cfg):
            continue
        for forbid in quirk.forbids:
            value = _get(cfg, forbid.key)
            if forbid.is_bad(value):
                raise ConfigError(
                    f"{forbid.key}={value} is not allowed for {cfg.model.name}: {forbid.reason}; {forbid.fix}"
                )
        for setting in quirk.settings(cfg):
            if not _has_key(cfg, setting.key):
                continue
            current = _get(cfg, setting.key)
            value = setting.value
            if isinstance(value, list):
                merged = list(current) if isinstance(current, list) else []
                merged += [v for v in value if v not in merged]
                value = merged
            elif setting.strict and current is not None and current != value:
                raise ConfigError(
                    f"{setting.key}={current} is not allowed for {cfg.model.name}: {setting.reason}; "
                    f"use {setting.key}={value} or leave it unset"
                )
            _set(cfg, setting.key, value)
            applied.append(AppliedQuirk(quirk.name, setting.key, value, setting.reason))
    return applied


def _has_key(cfg: RunConfig, key: str) -> bool:
    parent_key, _, leaf = key.rpartition(".")
    return hasattr(_get(cfg, parent_key), leaf)
