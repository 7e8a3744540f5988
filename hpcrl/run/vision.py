"""Prompts as the engines and the trainer take them: token ids, and for an image data set
(``data.image_field``) the images through the model's own processor.

The processor turns the chat template's text (one image placeholder per image) into the token ids the
model sees, each placeholder expanded into its image's tokens, and the pixel tensors the vision tower
reads. The trainer gets both (``TrainBatch.images``). The engine gets the placeholder form and the
images (``ImagePrompt``): vLLM runs the same processor on them and expands each placeholder itself, to
the same ids (tests/rollout/test_vision.py holds that: engine and trainer log-probs agree).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcrl.rollout.base import ImagePrompt, Prompt

if TYPE_CHECKING:
    import torch

    from hpcrl.data.config import DataConfig
    from hpcrl.data.loader import Example


@dataclass(frozen=True)
class Encoded:
    """One example's prompt as the loop hands it on."""

    ids: list[int]
    """The token ids the trainer trains on (an image's tokens expanded)."""
    engine: Prompt
    """What the engines generate from."""
    images: dict[str, torch.Tensor] | None = None
    """The processor's image tensors (pixel values ...), each with a leading dimension of 1."""


def prompt_encoder(
    model_dir: Path,
    data: DataConfig,
    text_encoder: Callable[[Path, DataConfig], tuple[Callable[[str], list[int]], int]],
) -> tuple[Callable[[Example], Encoded], int]:
    """Example -> ``Encoded``, and the pad id: through the model's processor for an image data set,
    else through ``text_encoder`` (``driver.make_encoder``: the tokenizer and chat template)."""
    encode, pad = text_encoder(model_dir, data)
    if data.image_field:
        return ImageEncoder(model_dir, data), pad

    def text(example: Example) -> Encoded:
        ids = encode(example.prompt)
        return Encoded(ids, ids)

    return text, pad


class ImageEncoder:
    """An image data set's examples through the model's processor (``AutoProcessor``: its chat
    template places the images, its image processor makes the pixel tensors)."""

    def __init__(self, model_dir: Path, data: DataConfig) -> None:
        from transformers import AutoProcessor

        from hpcrl.data.templates import earlier_turns

        self.processor = AutoProcessor.from_pretrained(model_dir)
        self.earlier = earlier_turns(data)
        self.extra = dict(data.chat_template_kwargs)

    def __call__(self, example: Example) -> Encoded:
        from PIL import Image

        pictures = [Image.open(io.BytesIO(data)).convert("RGB") for data in example.images]
        content: list[dict[str, Any]] = [{"type": "image"} for _ in pictures]
        content.append({"type": "text", "text": example.prompt})
        messages = [*self.earlier, {"role": "user", "content": content}]
        text = self.processor.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **self.extra
        )
        # the template writes every special token itself (as make_encoder's text prompts)
        placeholders = list(self.processor.tokenizer.encode(text, add_special_tokens=False))
        if not pictures:
            return Encoded(placeholders, placeholders)
        out = self.processor(text=text, images=pictures, return_tensors="pt", add_special_tokens=False)
        ids = out.pop("input_ids")[0].tolist()
        out.pop("attention_mask", None)
        return Encoded(ids, ImagePrompt(placeholders, pictures), dict(out))
