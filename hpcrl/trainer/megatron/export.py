"""``hpcrl export`` for megatron checkpoints: the layout-free Megatron pieces (sharded.py) under the
Hugging Face checkpoint's names (named in the backend table, ``trainer/backends.py``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from hpcrl.trainer.hf_checkpoint import HFCheckpoint
from hpcrl.trainer.megatron import weights, weights_hybrid
from hpcrl.trainer.megatron.model import model_shape
from hpcrl.trainer.megatron.spec import family_of, text_config
from hpcrl.trainer.megatron.weights import VLM_LAYOUTS, LanguageModel
from hpcrl.trainer.mtp import kinds_of


def hf_names(hf_dir: Path, source: Path) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """Layout-free Megatron pieces (megatron/sharded.py) -> the checkpoint's Hugging Face names
    (a vision-language checkpoint's text decoder under its own prefix)."""

    hf = text_config(hf_dir)
    shape = model_shape(hf, family_of(hf), 1)
    # sharded.py's unfused names; the MTP layers' kinds, for a checkpoint trained with them
    shape = replace(shape, fused_norms=False, mtp=kinds_of(hf) if shape.pattern else "")
    tied = bool(getattr(hf, "tie_word_embeddings", False))
    mapping = weights_hybrid if shape.pattern else weights
    lm = vlm_naming(hf_dir, source)

    def convert(pieces: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        whole: dict[str, list[tuple[int, torch.Tensor]]] = {}
        for key, t in pieces.items():
            name, _, part = key.partition("#part")
            whole.setdefault(name, []).append((int(part or 0), t))
        meg = {n: torch.cat([t for _, t in sorted(parts, key=lambda p: p[0])]) for n, parts in whole.items()}
        out = mapping.to_hf(meg, shape, tied)
        return lm.named({k: v for k, v in out.items() if not (tied and k == "lm_head.weight")})

    return convert


def vlm_naming(hf_dir: Path, source: Path) -> Any:
    """The causal-LM -> checkpoint naming of the model (weights.LanguageModel): a vision-language
    checkpoint keeps the source's prefix (else the published layout's)."""
    if "text_config" not in json.loads((hf_dir / "config.json").read_text()):
        return LanguageModel({})
    names = HFCheckpoint(source).names() if list(source.glob("*.safetensors")) else []
    for prefix, head in VLM_LAYOUTS.items():
        if any(n.startswith(prefix) for n in names):
            return LanguageModel({}, prefix, head)
    return LanguageModel({}, *next(iter(VLM_LAYOUTS.items())))
