"""The project's own tiny model: a character tokenizer and a small Qwen2-shaped network,
warm-started by a short supervised pass on the synthetic arithmetic task so GRPO has signal.

Built once per (architecture, warm-start recipe) and cached under ``<cache>/tiny-<hash>`` as a
normal Hugging Face directory (config.json, model.safetensors, tokenizer.json) that vLLM and
transformers load like any checkpoint. Torch/transformers are imported inside the functions.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import string
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpcrl.config.model import ModelConfig
from hpcrl.data.synthetic import Problem, synthetic_split

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = string.digits + "+-*/=() .,:?" + string.ascii_letters
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
WARM_START_VERSION = 4  # bump when the warm-start recipe below changes


TEACHER_RAMBLE = 0.6
"""Share of warm-start answers the teacher follows with a second guess ('15 16'). The warm start
imitates an imperfect teacher: the policy learns the arithmetic but, like models that run past
their answer, usually keeps writing, and math-verify then reads the last number. Learning to stop
after the answer is a global behaviour that RL with the verifier corrects within a few dozen steps,
on held-out problems too; the arithmetic itself keeps improving more slowly."""


def noisy_teacher(problems: list[Problem], ramble: float, seed: int) -> list[Problem]:
    import random

    rng = random.Random(seed + 7)
    out = []
    for p in problems:
        if rng.random() < ramble:
            p = Problem(p.prompt, f"{p.answer} {int(p.answer) + rng.choice((-2, -1, 1, 2))}")
        out.append(p)
    return out


def build_tokenizer(out_dir: Path, vocab_size: int) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(CHARS))}
    if len(vocab) > vocab_size:
        raise ValueError(f"tiny tokenizer needs {len(vocab)} ids, model.vocab_size is {vocab_size}")
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    tok.save_pretrained(out_dir)
    return tok


def build_model(model_cfg: ModelConfig, seed: int) -> Any:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=model_cfg.vocab_size,
        hidden_size=model_cfg.hidden_size,
        intermediate_size=model_cfg.ffn_hidden_size,
        num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_attention_heads,
        num_key_value_heads=model_cfg.num_kv_heads,
        head_dim=model_cfg.head_dim,
        max_position_embeddings=model_cfg.max_position_embeddings,
        tie_word_embeddings=model_cfg.tie_embeddings,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        torch_dtype="float32",
    )
    return Qwen2ForCausalLM(config)


def encode_sft(tok: Any, problems: list[Problem]) -> tuple[Any, Any]:
    """Token ids and loss mask (answer + EOS only) for supervised warm start."""
    import torch

    rows, masks = [], []
    for p in problems:
        prompt = [BOS_ID, *tok.encode(p.prompt, add_special_tokens=False)]
        answer = [*tok.encode(p.answer, add_special_tokens=False), EOS_ID]
        rows.append(prompt + answer)
        masks.append([0] * len(prompt) + [1] * len(answer))
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, (r, m) in enumerate(zip(rows, masks, strict=True)):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    return ids, mask


def warm_start(
    model: Any,
    tok: Any,
    problems: list[Problem],
    steps: int,
    batch: int,
    lr: float,
    seed: int,
    log: Callable[[str], None],
) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids, mask = encode_sft(tok, problems)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for step in range(steps):
        idx = torch.randint(0, ids.shape[0], (batch,), generator=gen)
        x, m = ids[idx], mask[idx]
        logits = model(input_ids=x, attention_mask=(x != PAD_ID).long()).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none")
        loss = (nll * m[:, 1:]).sum() / m[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            log(f"warm start {step + 1}/{steps}: loss {loss.item():.3f}")
    model.eval()


def tiny_model_dir(model_cfg: ModelConfig, cache: Path, sft_steps: int, seed: int) -> Path:
    recipe = {
        "arch": {
            k: getattr(model_cfg, k)
            for k in (
                "num_layers",
                "hidden_size",
                "num_attention_heads",
                "num_kv_heads",
                "head_dim",
                "ffn_hidden_size",
                "vocab_size",
                "tie_embeddings",
            )
        },
        "sft_steps": sft_steps,
        "seed": seed,
        "version": WARM_START_VERSION,
    }
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    return cache / f"tiny-{digest}"


def ensure_tiny_model(
    model_cfg: ModelConfig,
    cache: Path,
    *,
    sft_steps: int = 350,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> Path:
    """Build (or reuse) the warm-started tiny model; returns its Hugging Face directory."""
    out = tiny_model_dir(model_cfg, cache, sft_steps, seed)
    if (out / "model.safetensors").exists():
        return out
    started = time.perf_counter()
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok = build_tokenizer(tmp, model_cfg.vocab_size)
    model = build_model(model_cfg, seed)
    train, _ = synthetic_split(num_train=20000, num_val=256, seed=seed)
    train = noisy_teacher(train, TEACHER_RAMBLE, seed)
    if sft_steps:
        warm_start(model, tok, train, steps=sft_steps, batch=64, lr=1e-3, seed=seed, log=log)
    model.save_pretrained(tmp, safe_serialization=True)
    if out.exists():  # another process built the same model meanwhile
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, out)
    log(f"tiny model ready in {time.perf_counter() - started:.1f}s: {out}")
    return out
