"""The project's own tiny models: a character tokenizer and a small network of the catalog entry's
family (``tiny``: Qwen2; ``tiny_nemotronh``: Nemotron-H, Mamba-2 + attention + LatentMoE in Super's
layer order), warm-started by a short supervised pass on the synthetic arithmetic task so GRPO has
signal.

Built once per (architecture, warm-start recipe) and cached under ``<cache>/<name>-<hash>`` as a
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
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from hpcrl.config.model import LOCAL_PREFIX, ModelConfig
from hpcrl.data.synthetic import Problem, synthetic_split
from hpcrl.run import tiny_tools

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


def build_tokenizer(out_dir: Path, vocab_size: int, whole: tuple[str, ...] = ()) -> Any:
    """The character tokenizer; ``whole``: strings that are one token each (``run/tiny_tools.py``)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(CHARS) + list(whole))}
    if len(vocab) > vocab_size:
        raise ValueError(f"tiny tokenizer needs {len(vocab)} ids, model.vocab_size is {vocab_size}")
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.add_tokens(list(whole))  # matched before the split into characters, at their vocabulary ids
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    tok.save_pretrained(out_dir)
    return tok


def build_model(model_cfg: ModelConfig, seed: int) -> Any:
    """A randomly initialised network of ``model_cfg``'s family (``BUILDERS``)."""
    import torch

    builder = BUILDERS.get(model_cfg.family)
    if builder is None:
        raise ValueError(
            f"model.family={model_cfg.family!r}: hpcrl builds tiny models of the families "
            f"{', '.join(BUILDERS)} only; pick one of those or point model.hf_id at a checkpoint"
        )
    torch.manual_seed(seed)
    return builder(model_cfg)


def _qwen2(model_cfg: ModelConfig) -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

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


NEMOTRON_H_FIXED = {
    # Nemotron 3 Super's values for what the catalog does not describe (notes/nemotron-h.md §0)
    "conv_kernel": 4,
    "mamba_hidden_act": "silu",
    "use_conv_bias": True,
    "time_step_min": 0.001,
    "routed_scaling_factor": 5.0,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "mlp_hidden_act": "relu2",
    "use_bias": False,
    "mlp_bias": False,
    "layer_norm_epsilon": 1e-5,
    # Super's chunk is 128; our sequences are ~16 tokens, so chunks of 8 keep the inter-chunk
    # recurrence of the SSD scan in play (one chunk would never exercise it)
    "chunk_size": 8,
}


def _nemotron_h(model_cfg: ModelConfig) -> Any:
    from transformers import NemotronHConfig, NemotronHForCausalLM

    from hpcrl.trainer.mtp import attach

    h = model_cfg.hybrid
    dense = {"intermediate_size": model_cfg.ffn_hidden_size} if model_cfg.ffn_hidden_size else {}
    # the catalog's MTP blocks (model.mtp_layers; the pattern is checked to be there when they are)
    mtp: dict[str, Any] = {"num_nextn_predict_layers": model_cfg.mtp_layers}
    if model_cfg.mtp_layers:
        mtp["mtp_hybrid_override_pattern"] = h.mtp_pattern
    config = NemotronHConfig(
        vocab_size=model_cfg.vocab_size,
        hidden_size=model_cfg.hidden_size,
        hybrid_override_pattern=h.pattern,
        num_attention_heads=model_cfg.num_attention_heads,
        num_key_value_heads=model_cfg.num_kv_heads,
        head_dim=model_cfg.head_dim,
        max_position_embeddings=model_cfg.max_position_embeddings,
        mamba_num_heads=h.mamba_heads,
        mamba_head_dim=h.mamba_head_dim,
        ssm_state_size=h.mamba_state,
        n_groups=h.mamba_groups,
        n_routed_experts=model_cfg.num_experts,
        num_experts_per_tok=model_cfg.experts_per_token,
        moe_intermediate_size=model_cfg.moe_ffn_hidden_size,
        moe_latent_size=model_cfg.moe_latent_size or None,
        n_shared_experts=1 if model_cfg.shared_expert_ffn else 0,
        moe_shared_expert_intermediate_size=model_cfg.shared_expert_ffn,
        tie_word_embeddings=model_cfg.tie_embeddings,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        **dense,
        **NEMOTRON_H_FIXED,
        **mtp,
    )
    model = NemotronHForCausalLM(config)
    if model_cfg.mtp_layers:  # transformers builds none; saved with the model under the checkpoint's names
        attach(model, model_cfg.mtp_layers)
        # built after post_init: parameters transformers makes with torch.empty (Mamba's A_log, D, the experts)
        # would hold whatever memory they got (NaN losses in CI), so they get the model's own init
        model.mtp.apply(model._init_weights)
    return model


BUILDERS: dict[str, Callable[[ModelConfig], Any]] = {"qwen2": _qwen2, "nemotron_h": _nemotron_h}
"""The catalog families hpcrl builds tiny models of (``model.family``)."""


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


@dataclass(frozen=True)
class WarmStart:
    """The supervised warm start of one family's tiny model (part of the cache key)."""

    steps: int
    lr: float
    bias_rate: float = 0.0
    """Auxiliary-loss-free balancing of the MoE routers' correction bias (``CorrectionBiasBalancer``)."""


Recipe = WarmStart | tiny_tools.ToolWarmStart
WARM_STARTS = {"qwen2": WarmStart(350, 1e-3), "nemotron_h": WarmStart(350, 1e-3, bias_rate=1e-3)}


class CorrectionBiasBalancer:
    """DeepSeek-V3's auxiliary-loss-free load balancing, which is how Super's routers got their
    ``e_score_correction_bias`` in pretraining: after each step every router's bias moves by ``rate``
    toward equal expert load (up for experts picked less than average, down for those picked more).
    The bias only selects experts (the weights come from the unbiased scores), so the tiny model
    ends with a real, nonzero fp32 bias that RL must keep exactly (the nemotron_h quirk)."""

    def __init__(self, model: Any, rate: float) -> None:
        self.rate = rate
        self.loads: dict[Any, Any] = {}
        routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
        self.handles = [r.register_forward_hook(self._count) for r in routers]

    def _count(self, router: Any, _inputs: Any, output: Any) -> None:
        import torch

        indices = output[2]  # (logits, weights, indices): NemotronHTopkRouter's output
        self.loads[router] = torch.bincount(indices.flatten(), minlength=router.num_experts).float()

    def step(self) -> None:
        import torch

        with torch.no_grad():
            for router, load in self.loads.items():
                router.e_score_correction_bias += self.rate * torch.sign(load.mean() - load)
        self.loads.clear()

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def warm_start(
    model: Any,
    rows: tuple[Any, Any],
    recipe: Recipe,
    batch: int,
    seed: int,
    log: Callable[[str], None],
) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids, mask = rows  # token ids and the loss mask (``encode_sft``)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.0)
    balancer = CorrectionBiasBalancer(model, recipe.bias_rate) if recipe.bias_rate else None
    model.train()
    for step in range(recipe.steps):
        idx = torch.randint(0, ids.shape[0], (batch,), generator=gen)
        x, m = ids[idx], mask[idx]
        # right-padded rows: with the mask left out no real token sees a pad (causal), on every
        # path (the fused Mamba kernels take right padding only)
        logits = model(input_ids=x).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none")
        loss = (nll * m[:, 1:]).sum() / m[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if balancer:
            balancer.step()
        if step % 50 == 0 or step == recipe.steps - 1:
            log(f"warm start {step + 1}/{recipe.steps}: loss {loss.item():.3f}")
    if balancer:
        balancer.close()
    model.eval()


def tiny_model_dir(model_cfg: ModelConfig, cache: Path, recipe: Recipe, seed: int) -> Path:
    """``<cache>/<name>-<hash>``: the hash covers every architecture field (the family, the hybrid
    layout, the experts ...), the warm start and the seed, so no two builds share a directory."""
    arch = {k: v for k, v in asdict(model_cfg).items() if k not in ("name", "hf_id", "stated_params_b")}
    key = {"arch": arch, "warm_start": asdict(recipe), "seed": seed, "version": WARM_START_VERSION}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return cache / f"{model_cfg.name}-{digest}"


def ensure_tiny_model(
    model_cfg: ModelConfig,
    cache: Path,
    *,
    sft_steps: int | None = None,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> Path:
    """Build (or reuse) the warm-started tiny model; returns its Hugging Face directory.
    ``sft_steps``: None takes the family's warm start (``WARM_STARTS``), 0 skips it."""
    tools = tiny_tools.uses_tools(model_cfg)
    recipe = tiny_tools.TOOL_WARM_START if tools else WARM_STARTS.get(model_cfg.family, WARM_STARTS["qwen2"])
    if sft_steps is not None:
        recipe = replace(recipe, steps=sft_steps)
    out = tiny_model_dir(model_cfg, cache, recipe, seed)
    if (out / "model.safetensors").exists():
        return out
    started = time.perf_counter()
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok = build_tokenizer(tmp, model_cfg.vocab_size, tiny_tools.TOOL_TOKENS if tools else ())
    model = build_model(model_cfg, seed)
    if recipe.steps and isinstance(recipe, tiny_tools.ToolWarmStart):
        rows = tiny_tools.encode_traces(tiny_tools.run_tokenizer(model, tmp), recipe, seed)
        warm_start(model, rows, recipe, batch=64, seed=seed, log=log)
    elif recipe.steps:
        train, _ = synthetic_split(num_train=20000, num_val=256, seed=seed)
        rows = encode_sft(tok, noisy_teacher(train, TEACHER_RAMBLE, seed))
        warm_start(model, rows, recipe, batch=64, seed=seed, log=log)
    model.save_pretrained(tmp, safe_serialization=True)
    if out.exists():  # another process built the same model meanwhile
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, out)
    log(f"tiny model ready in {time.perf_counter() - started:.1f}s: {out}")
    return out


def is_tiny(model_cfg: ModelConfig) -> bool:
    """Catalog entries hpcrl builds itself (``hf_id: local/...``) rather than downloads."""
    return model_cfg.hf_id.startswith(LOCAL_PREFIX)
