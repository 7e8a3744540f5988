"""Helpers the megatron tests share (tests/trainer's fsdp ones too): small random Gemma 3 and Gemma 4
models, one parity run under torchrun (tests/harness/megatron_parity.py), and the checks of a step
and of an export."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT
from tests.harness.zygote import torchrun

GEMMA3_TEXT = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    query_pre_attn_scalar=24,
    sliding_window=4,
    tie_word_embeddings=True,
    max_position_embeddings=256,
    rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    },
)
"""A small Gemma 3 where every quirk shows on the parity batch (sequences of up to 8 tokens): a
4-token sliding window on layers 0-2 and a global layer 3 (so PP=2 splits sliding from mixed), two
RoPE bases and linear scaling, a softmax scale that is not head_dim ** -0.5."""


def gemma3_model(vlm: bool = False, **overrides: object) -> torch.nn.Module:
    """Random weights; the norms drawn around 0 (Gemma's norms multiply by 1 + w: zeros would hide a
    norm that forgot the 1)."""
    from transformers import Gemma3Config, Gemma3ForCausalLM, Gemma3ForConditionalGeneration, Gemma3TextConfig

    torch.manual_seed(0)
    text = Gemma3TextConfig(**{**GEMMA3_TEXT, **overrides})
    text.layer_types = ["sliding_attention"] * (text.num_hidden_layers - 1) + ["full_attention"]
    if vlm:
        vision = dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        )
        config = Gemma3Config(
            text_config=text.to_dict(),
            vision_config=vision,
            mm_tokens_per_image=4,
            image_token_index=127,
            boi_token_index=125,
            eoi_token_index=126,
        )
        model: torch.nn.Module = Gemma3ForConditionalGeneration(config)
    else:
        model = Gemma3ForCausalLM(text)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0, 0.3)
    return model


GEMMA4_TEXT = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    sliding_window=4,
    tie_word_embeddings=True,
    max_position_embeddings=256,
    hidden_size_per_layer_input=0,
    layer_types=["sliding_attention"] * 3 + ["full_attention"],
)
"""A small Gemma 4 dense decoder (31B's kind): 4-token windows on layers 0-2, a global layer 3 with
twice the head size, its own KV heads and keys doubling as values, proportional RoPE there."""


def gemma4_model(vlm: bool = False, **overrides: object) -> torch.nn.Module:
    """Random weights; norms drawn around 1 (Gemma 4's norms multiply by w), a different
    ``layer_scalar`` per layer (ones would hide a layer that forgot it)."""
    from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration, Gemma4TextConfig

    torch.manual_seed(0)
    text = {**GEMMA4_TEXT, **overrides}
    if vlm:
        vision = dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=16,
            patch_size=4,
        )
        tokens = dict(
            image_token_id=127,
            boi_token_id=125,
            eoi_token_id=126,
            video_token_id=124,
            boa_token_id=123,
            eoa_token_index=122,
            audio_token_id=121,
        )
        model: torch.nn.Module = Gemma4ForConditionalGeneration(
            Gemma4Config(text_config=text, vision_config=vision, audio_config=None, **tokens)
        )
    else:
        model = Gemma4ForCausalLM(Gemma4TextConfig(**text))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1, 0.3)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.fill_(0.5 + 0.25 * int(name.split(".layers.")[1].split(".")[0]))
    return model


def gemma4_moe_model(**overrides: object) -> torch.nn.Module:
    """A small Gemma 4 with 26B-A4B's MoE block in both layers (a sliding and a global one): 4 experts,
    top-2; router scales and experts drawn away from their ones/zeros."""
    text = dict(
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        num_global_key_value_heads=2,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
    )
    model = gemma4_model(**{**text, **overrides})
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "router.scale" in name or "per_expert_scale" in name:
                param.uniform_(0.5, 1.5)
            elif ".experts." in name:
                param.normal_(0, 0.2)
    return model


def _torchrun(
    model_dir: Path,
    out: Path,
    tp: int,
    pp: int,
    backend: str = "megatron",
    port: int = 29631,
    dp: int = 1,
    cp: int = 1,
    extra: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    algo: tuple[str, ...] = (),
) -> dict:
    """One parity run (tests/harness/megatron_parity.py); ``env``: its HPCRL_PARITY_* switches (a second
    step after the checkpoint, or a resume from one); ``algo``: overrides for either backend."""
    env = {
        **os.environ,
        "HPCRL_PARITY_OVERRIDES": " ".join(
            ((f"trainer.cp={cp}", *extra) if backend == "megatron" else ()) + algo
        ),
        **(env or {}),
    }
    args = [str(model_dir), str(out), str(tp), str(pp), backend]
    script = ROOT / "tests" / "harness" / "megatron_parity.py"
    done = torchrun(script, args, max(1, tp * pp * cp * dp), port, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out)


def _assert_same_step(run: dict, base: dict, mask: torch.Tensor, where: str) -> None:
    """Log-probs, the step's metrics (grad_norm: before clipping), gradients and updated weights."""
    assert torch.allclose(run["logp"][mask], base["logp"][mask], atol=1e-5), where
    for key in ("loss", "policy_loss", "kl", "entropy", "grad_norm"):
        assert run["metrics"][key] == pytest.approx(base["metrics"][key], rel=1e-4, abs=1e-6), (where, key)
    assert run["grads"].keys() == base["grads"].keys(), where
    for name, grad in base["grads"].items():
        assert torch.allclose(run["grads"][name], grad, atol=1e-5), (where, name)
    for name, weight in base["weights"].items():
        assert torch.allclose(run["weights"][name], weight, atol=1e-6), (where, name)


def assert_exports_to(
    weights: dict[str, torch.Tensor], trainer_dir: Path, model_dir: Path, backend: str = "megatron"
) -> None:
    """``hpcrl export`` of a parity run's checkpoint (every rank's pieces) loads in transformers with
    exactly the trained ``weights``, under the source checkpoint's names and no others."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from hpcrl.tools.export import write_export

    out = trainer_dir.with_suffix(".hf")
    about = {"backend": backend, "source": str(model_dir)}
    write_export(trainer_dir, about, model_dir, out, "fp32", log=lambda _: None)
    with safe_open(str(model_dir / "model.safetensors"), "pt") as src:
        source_names = set(src.keys())
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == source_names
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    from hpcrl.trainer.fsdp import checkpoint_names

    state = checkpoint_names(exported, exported.state_dict())
    tied = exported.config.get_text_config().tie_word_embeddings
    for name, value in weights.items():
        if name not in state:  # the head the trainer sends engines for a tied model: not a weight of its own
            assert tied and name.endswith("lm_head.weight"), name
            continue
        assert torch.equal(state[name], value), name
