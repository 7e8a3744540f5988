"""``hpcrl export`` for fsdp checkpoints: transformers' in-memory names under the checkpoint's (named
in the backend table, ``trainer/backends.py``; ``source`` is unused: fsdp holds every weight)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch


def hf_names(hf_dir: Path, source: Path) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """The fsdp backend's names (transformers' in-memory ones) -> the checkpoint's."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    config = AutoConfig.from_pretrained(hf_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tied = bool(getattr(config.get_text_config(), "tie_word_embeddings", False))
    head = next((n for n in model.state_dict() if n.endswith("lm_head.weight")), "lm_head.weight")

    def convert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        state = {k: v for k, v in state.items() if not (tied and k == head)}
        return dict(revert_weight_conversion(model, state))

    return convert
