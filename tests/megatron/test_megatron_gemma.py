"""Megatron-core backend, Gemma: a Gemma 3 (TP, PP, CP; its VLM's text decoder) and a Gemma 4 (layers of
two shapes, keys as values; TP, PP, CP, soft-capped logits, its VLM; 26B-A4B's MoE block under EP,
TP x EP, PP, CP; packed rows, each) give fsdp's step; the window mask, the zero-centered norm and flex window attention
by hand."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from hpcrl.trainer.megatron.weights import (
    Shape,
    to_hf,
    to_megatron,
)
from tests.conftest import JOB_DOWNLOADS, run_cli
from tests.harness.megatron_parity import parity_batch
from tests.megatron.common import (
    _assert_same_step,
    _torchrun,
    assert_exports_to,
    gemma3_model,
    gemma4_model,
    gemma4_moe_model,
)

PACKING = ("trainer.packing=true", "trainer.micro_batch_tokens=16")
"""Packed rows of two parity sequences each (the last alone, padded to the 16)."""


def test_vlm_checkpoint_trains_its_text_decoder_and_exports_under_its_own_names():
    """Gemma3ForConditionalGeneration as saved (the published layout): the text decoder maps to
    Megatron and back bit-identically under the checkpoint's names; the vision tower is left out."""
    from safetensors.torch import load_file

    from hpcrl.trainer.megatron.weights import LanguageModel

    with tempfile.TemporaryDirectory() as tmp:
        gemma3_model(vlm=True).save_pretrained(tmp)
        state = load_file(Path(tmp) / "model.safetensors")
    lm = LanguageModel.of(state)
    vision = [k for k in state if not k.startswith("language_model.")]
    assert vision and lm.left_out == len(vision) and lm.prefix == "language_model.model."
    assert all(k.startswith("model.") for k in lm.text)
    shape = Shape(heads=4, groups=2, head_dim=16, vocab=128, padded_vocab=128, sandwich_norms=True)
    back = lm.named(to_hf(to_megatron(lm.text, shape, tied=True), shape, tied=True))
    # the tied head is sent as the rollout engines' lm_head
    assert torch.equal(
        back.pop("language_model.lm_head.weight"), state["language_model.model.embed_tokens.weight"]
    )
    assert back.keys() == {k for k in state if k.startswith("language_model.")}
    for name, tensor in back.items():
        assert torch.equal(tensor, state[name]), name
    plain = {"model.norm.weight": torch.ones(2)}  # a causal LM passes through unchanged
    assert LanguageModel.of(plain).named(plain) is plain


def test_window_mask_and_zero_centered_norm_by_hand():
    from types import SimpleNamespace

    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from hpcrl.trainer.megatron.attention import window_mask
    from hpcrl.trainer.megatron.norms import SPNorm

    # query i reads keys i-1 and i (window 2), never a later one
    assert window_mask(4, 2, torch.device("cpu")).int().tolist() == [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [0, 1, 1, 0],
        [0, 0, 1, 1],
    ]
    ours = SPNorm(SimpleNamespace(sequence_parallel=False, layernorm_zero_centered_gamma=True), 8, eps=1e-6)
    hf = Gemma3RMSNorm(8, eps=1e-6)
    with torch.no_grad():
        ours.weight.copy_(torch.linspace(-0.5, 0.5, 8))
        hf.weight.copy_(ours.weight)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    assert (
        torch.equal(ours(x), hf(x)) and ours(x).dtype == torch.bfloat16
    )  # x (1 + w) in fp32, then x's dtype
    plain = SPNorm(SimpleNamespace(sequence_parallel=False), 8, eps=1e-6)
    with torch.no_grad():
        plain.weight.copy_(ours.weight)
    assert not torch.allclose(plain(x.float()), ours(x.float()), atol=1e-3)  # the offset matters


@pytest.fixture(scope="module")
def gemma3_dirs(tmp_path_factory):
    """A small Gemma3ForCausalLM and a small Gemma3ForConditionalGeneration (same text config)."""
    out = {}
    for kind in ("text", "vlm"):
        out[kind] = tmp_path_factory.mktemp(f"gemma3_{kind}")
        gemma3_model(vlm=kind == "vlm").save_pretrained(out[kind])
    return out


@pytest.mark.slow
def test_gemma3_matches_fsdp_and_under_tensor_and_pipeline_parallel(gemma3_dirs, tmp_path):
    """Gemma 3 (sandwich norms, 1 + w norms, sliding window, two RoPE bases, scaled embeddings, GeGLU)
    built by Megatron gives the Hugging Face model's step (fsdp backend); TP=2 with sequence parallel
    (the post norms' partial grads summed over TP) and PP=2 (sliding layers on stage 0, the global one on
    stage 1) and CP=2 (windows across the CP chunks) give the one-rank step; the VLM's text decoder
    trains the same under its own names. Packed (``trainer.packing``, bins of 16 tokens) too: every
    layer reads the sequences' bounds, the sliding ones each query's window inside its sequence, and no
    [L, L] mask is built."""
    from transformers import AutoModelForCausalLM

    from hpcrl.trainer.fsdp import checkpoint_names

    mask = parity_batch().loss_mask.bool()
    for kind, port in (("text", 29751), ("vlm", 29753)):
        base = _torchrun(gemma3_dirs[kind], tmp_path / f"{kind}1.pt", 1, 1, port=port)
        fsdp = _torchrun(gemma3_dirs[kind], tmp_path / f"{kind}fsdp.pt", 1, 1, backend="fsdp", port=port + 1)
        assert torch.allclose(base["logp"][mask], fsdp["logp"][mask], atol=1e-5), kind
        for key in ("loss", "policy_loss", "kl", "entropy", "grad_norm"):
            assert base["metrics"][key] == pytest.approx(fsdp["metrics"][key], rel=1e-4, abs=1e-6), (
                kind,
                key,
            )
        # both backends' checkpoints export to the trained weights, a VLM's frozen tower copied along
        assert_exports_to(base["weights"], tmp_path / f"{kind}1.ckpt", gemma3_dirs[kind])
        assert_exports_to(fsdp["weights"], tmp_path / f"{kind}fsdp.ckpt", gemma3_dirs[kind], backend="fsdp")
        hf_grads = checkpoint_names(AutoModelForCausalLM.from_pretrained(gemma3_dirs[kind]), fsdp["grads"])
        head = "language_model.lm_head.weight" if kind == "vlm" else "lm_head.weight"
        assert set(base["grads"]) - {head} == set(hf_grads), kind  # every text weight, no vision weight
        for name, grad in hf_grads.items():
            assert torch.allclose(base["grads"][name], grad, atol=1e-5), (kind, name)
        if kind == "text":
            assert base["layout"]["qk_norms"] == 4
            text = base
    # CP=2: 4 chunks of ~3 tokens, so the 4-token windows reach across chunks and CP ranks
    for tp, pp, cp in ((2, 1, 1), (1, 2, 1), (1, 1, 2)):
        where = f"gemma3 TP={tp} PP={pp} CP={cp}"
        run = _torchrun(
            gemma3_dirs["text"],
            tmp_path / f"tp{tp}pp{pp}cp{cp}.pt",
            tp,
            pp,
            cp=cp,
            port=29755 + tp + 2 * pp + 4 * cp,
        )
        assert run["layout"]["sequence_parallel"] == (tp > 1) and run["layout"]["cp"] == cp, where
        _assert_same_step(run, text, mask, where)
        assert all(run["state_restored"]), where
    run = _torchrun(gemma3_dirs["text"], tmp_path / "packed.pt", 1, 1, port=29769, extra=PACKING)
    assert run["layout"]["packed_masks"] == 0  # sliding layers too attend by the bounds
    _assert_same_step(run, text, mask, "gemma3 packed")


@pytest.fixture(scope="module")
def gemma4_dirs(tmp_path_factory):
    """A small Gemma4ForCausalLM (2 KV heads in the global layer too, so TP=2 splits them) and a
    Gemma4ForConditionalGeneration whose logits are soft-capped at 2 (the tiny model's logits reach it)."""
    out = {}
    for kind, extra in (("text", {}), ("vlm", {"final_logit_softcapping": 2.0})):
        out[kind] = tmp_path_factory.mktemp(f"gemma4_{kind}")
        gemma4_model(vlm=kind == "vlm", num_global_key_value_heads=2, **extra).save_pretrained(out[kind])
    return out


@pytest.mark.slow
def test_gemma4_matches_fsdp_and_under_tensor_pipeline_and_context_parallel(gemma4_dirs, tmp_path):
    """Gemma 4's dense decoder (sliding layers 16 x 2 KV heads, a global layer 32 x 2 whose keys are its
    values, V norm, x * w norms, proportional RoPE, layer_scalar) built by Megatron gives the Hugging Face
    model's step; TP=2, PP=2 (the global layer alone on stage 1) and CP=2 give the one-rank step; the
    VLM's text decoder, its logits soft-capped, trains the same under its own names, with TP=2 too, there
    packed (``trainer.packing``, bins of 16 tokens: the class the recipes load; every layer, sliding and
    keys-as-values global, reads the sequences' bounds, no [L, L] mask; unpacked TP=2 is the text run's)."""
    from transformers import AutoModelForCausalLM

    from hpcrl.trainer.fsdp import checkpoint_names

    mask = parity_batch().loss_mask.bool()
    base = {}
    for kind, port in (("text", 29771), ("vlm", 29773)):
        base[kind] = _torchrun(gemma4_dirs[kind], tmp_path / f"{kind}1.pt", 1, 1, port=port)
        fsdp = _torchrun(gemma4_dirs[kind], tmp_path / f"{kind}fsdp.pt", 1, 1, backend="fsdp", port=port + 1)
        assert torch.allclose(base[kind]["logp"][mask], fsdp["logp"][mask], atol=1e-5), kind
        for key in ("loss", "policy_loss", "kl", "entropy", "grad_norm"):
            assert base[kind]["metrics"][key] == pytest.approx(fsdp["metrics"][key], rel=1e-4, abs=1e-6), (
                kind,
                key,
            )
        assert_exports_to(base[kind]["weights"], tmp_path / f"{kind}1.ckpt", gemma4_dirs[kind])
        assert_exports_to(fsdp["weights"], tmp_path / f"{kind}fsdp.ckpt", gemma4_dirs[kind], backend="fsdp")
        hf_grads = checkpoint_names(AutoModelForCausalLM.from_pretrained(gemma4_dirs[kind]), fsdp["grads"])
        head = "lm_head.weight"
        assert set(base[kind]["grads"]) - {head} == set(hf_grads), kind  # every text weight, no vision weight
        assert not any(k.endswith("layers.3.self_attn.v_proj.weight") for k in hf_grads)  # keys as values
        for name, grad in hf_grads.items():
            assert torch.allclose(base[kind]["grads"][name], grad, atol=1e-5), (kind, name)
    for kind, tp, pp, cp in (("text", 2, 1, 1), ("text", 1, 2, 1), ("text", 1, 1, 2), ("vlm", 2, 1, 1)):
        packed = kind == "vlm"
        where = f"gemma4 {kind} TP={tp} PP={pp} CP={cp}" + " packed" * packed
        run = _torchrun(
            gemma4_dirs[kind],
            tmp_path / f"{kind}tp{tp}pp{pp}cp{cp}.pt",
            tp,
            pp,
            cp=cp,
            port=29775 + tp + 2 * pp + 4 * cp + 10 * (kind == "vlm"),
            extra=PACKING if packed else (),
        )
        assert run["layout"]["sequence_parallel"] == (tp > 1) and run["layout"]["cp"] == cp, where
        assert run["layout"]["pack_width"] == (16 if packed else None), where
        assert run["layout"]["packed_masks"] == 0, where
        _assert_same_step(run, base[kind], mask, where)
        assert all(run["state_restored"]), where


def test_gemma3_plans_and_renders_with_megatron_on_cpus_and_gpu_clusters(tmp_path):
    # this machine's CPUs (1B does not fit the local 16 GB budget: refused for memory, the check after
    # the backend's, so megatron can build it)
    local = run_cli("plan", "model=gemma3_1b", "trainer=megatron")
    assert "gemma3" in local.stdout and local.returncode == 2, local.stdout[-2000:]
    assert local.stderr.startswith("hpcrl: error: gemma3_1b fits no layout on local"), local.stderr
    site = ["cluster.slurm.account=a", "cluster.container.image=i.sqsh", "cluster=b200", *JOB_DOWNLOADS]
    plan = run_cli("plan", "model=gemma3_1b", "trainer=megatron", *site)
    assert plan.returncode == 0, plan.stderr
    assert "rollout.block_size=32" in plan.stdout
    rendered = run_cli("render", "--out", str(tmp_path / "r"), "model=gemma3_1b", "trainer=megatron", *site)
    assert rendered.returncode == 0, rendered.stderr
    # the backend is the schema's class, not a field: the header names it, megatron's own fields show it
    resolved = (tmp_path / "r" / "config.yaml").read_text()
    assert resolved.startswith("# trainer=megatron rollout=vllm\n")
    assert "distributed_optimizer: true" in resolved
    assert "#SBATCH" in (tmp_path / "r" / "sbatch.sh").read_text()
    # NeMo RL's DTensor CP fails on the sliding window; both of hpcrl's CP attentions apply it
    for backend in ("megatron", "fsdp"):
        cp2 = run_cli("plan", "model=gemma3_4b", f"trainer={backend}", "trainer.cp=2", *site)
        assert cp2.returncode == 0, cp2.stderr[-2000:]


@pytest.fixture(scope="module")
def gemma4_moe_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("gemma4_moe")
    gemma4_moe_model().save_pretrained(out)
    return out


@pytest.mark.slow
def test_gemma4_moe_block_matches_fsdp_and_under_expert_tensor_pipeline_and_context_parallel(
    gemma4_moe_dir, tmp_path
):
    """26B-A4B's layer: a dense MLP beside an MoE whose router reads the raw residual (own norm, scale,
    per-expert scale). Megatron = Hugging Face's step (fsdp backend), every expert and router weight's
    gradient included; EP2 (packed: bins of 16 tokens, the router and experts see each row's padding
    past its last sequence, which no real token's output reads), TP2 x EP2 (sequence parallel), PP2 and
    CP2 give the one-rank step."""
    mask = parity_batch().loss_mask.bool()
    moe = ("trainer.moe_aux_loss_coeff=0",)
    base = _torchrun(gemma4_moe_dir, tmp_path / "tp1.pt", 1, 1, port=29791, extra=moe)
    assert base["layout"]["experts"] == ["GroupedExperts"]
    fsdp = _torchrun(gemma4_moe_dir, tmp_path / "fsdp.pt", 1, 1, backend="fsdp", port=29792)
    assert torch.allclose(base["logp"][mask], fsdp["logp"][mask], atol=1e-5)
    for key in ("loss", "policy_loss", "kl", "entropy", "grad_norm"):
        assert base["metrics"][key] == pytest.approx(fsdp["metrics"][key], rel=1e-4, abs=1e-6), key
    assert set(base["grads"]) - {"lm_head.weight"} == set(fsdp["grads"])
    assert {"model.layers.1.experts.gate_up_proj", "model.layers.0.router.per_expert_scale"} <= set(
        fsdp["grads"]
    )
    for name, grad in fsdp["grads"].items():
        assert torch.allclose(base["grads"][name], grad, atol=1e-5), name
    assert_exports_to(base["weights"], tmp_path / "tp1.ckpt", gemma4_moe_dir)  # experts stacked back
    assert_exports_to(fsdp["weights"], tmp_path / "fsdp.ckpt", gemma4_moe_dir, backend="fsdp")
    for tp, pp, cp, ep in ((1, 1, 1, 2), (2, 1, 1, 2), (1, 2, 1, 1), (1, 1, 2, 1)):
        packed = (tp, ep) == (1, 2)
        where = f"gemma4 MoE TP={tp} PP={pp} CP={cp} EP={ep}" + " packed" * packed
        # EP is carved out of the TP x DP ranks: DP = EP where TP x EP ranks run
        run = _torchrun(
            gemma4_moe_dir,
            tmp_path / f"tp{tp}pp{pp}cp{cp}ep{ep}.pt",
            tp,
            pp,
            cp=cp,
            dp=ep,
            port=29793 + tp + 2 * pp + 4 * cp + 8 * ep,
            extra=(*moe, f"trainer.ep={ep}", *(PACKING if packed else ())),
        )
        assert run["layout"]["sequence_parallel"] == (tp > 1) and run["layout"]["cp"] == cp, where
        assert run["layout"]["pack_width"] == (16 if packed else None), where
        assert run["layout"]["packed_masks"] == 0, where
        _assert_same_step(run, base, mask, where)
        assert all(run["state_restored"]), where


def test_gemma4_plans_with_megatron_and_its_variants_beyond_the_dense_decoder_are_refused(tmp_path):
    site = ["cluster.slurm.account=a", "cluster.container.image=i.sqsh", *JOB_DOWNLOADS]
    # the shipped recipe: 4 x 8 H100, TP4 x PP2 x DP4 colocated with vLLM, fits in 80 GB
    recipe = ["+experiment=dapo-gemma4-31b-it-4n8g-megatron"]
    plan = run_cli("plan", *recipe, *site)
    assert plan.returncode == 0, plan.stdout[-2000:] + plan.stderr
    assert "fits: peak" in plan.stdout
    assert "│ train   │ 32   │ 4  │ 2  │ 1  │ 1  │ 4  │" in plan.stdout
    # keys double as values on the 4 global KV heads: TP=8 cannot split them
    tp8 = run_cli("plan", *recipe, "trainer.tp=8", "trainer.pp=1", *site)
    assert "trainer.tp=8 must divide the 4 KV heads of gemma4_31b" in " ".join(tp8.stderr.split())
    # and the 26B-A4B's: TP2 x EP16 on the same 4 x 8 H100
    moe = run_cli("plan", "+experiment=dapo-gemma4-26ba4b-it-4n8g-megatron", *site)
    assert moe.returncode == 0, moe.stdout[-2000:] + moe.stderr
    assert "│ train   │ 32   │ 2  │ 1  │ 1  │ 16 │ 16 │" in moe.stdout
    for model, what in (("gemma4_e2b", "per-layer embeddings"), ("gemma4_e4b", "KV-shared layers")):
        refused = run_cli("plan", f"model={model}", "trainer=megatron", "cluster=h200", *site)
        assert refused.returncode == 2 and f"cannot build {model} yet" in refused.stderr
        assert what in " ".join(refused.stderr.split())
    submitted = run_cli(
        "submit", "model=gemma4_e2b", "trainer=megatron", "cluster=h200", f"run.output_root={tmp_path}", *site
    )
    assert submitted.returncode == 2 and "cannot build gemma4_e2b yet" in submitted.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written, nothing submitted


def test_flex_window_attention_equals_masked_sdpa():
    """The GPU path for sliding-window layers (flex_attention over a block mask) computes what the
    masked SDPA does (here the eager flex_attention, forward only: its backward and the compiled kernel
    are GPU-only; bench/window_attention_bench.py compares their gradients on the GPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    from hpcrl.trainer.megatron.attention import flex_window_attention, window_mask

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 160, 16, generator=gen) for h in (4, 2, 2))
    flex = flex_window_attention(q, k, v, 40, 0.3, kernel=flex_attention)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=window_mask(160, 40, q.device), scale=0.3, enable_gqa=True
    )
    assert torch.allclose(flex, sdpa, atol=1e-5)
    far = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=0.3, enable_gqa=True
    )
    assert not torch.allclose(flex, far, atol=1e-3)  # the window cut keys off
