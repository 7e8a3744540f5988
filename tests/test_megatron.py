"""Megatron-core backend: HF<->Megatron weight mapping (exact round trips, Qwen3-MoE and Gemma 3 too) and,
under torchrun with gloo on CPU, TP=2 (sequence parallel) / PP=2 / TP=2xPP=2 / DP=2 / CP=2 / TP=2xCP=2 /
PP=2xCP=2 giving the TP=1 losses and gradients, TP=1 giving fsdp's; a Qwen3 (Q/K norms), a Qwen3-MoE
(EP, EP x PP, TP, TP x EP, CP, EP x CP, expert TP), a Gemma 3 (TP, PP, CP; its VLM's text decoder) and
a Gemma 4 (layers of two shapes, keys as values; TP, PP, CP, soft-capped logits, its VLM; 26B-A4B's MoE
block under EP, TP x EP, PP, CP) likewise. The parity batch holds the pad id inside sequences (Hugging
Face's padding_idx row)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch

from hpcrl.trainer.megatron.weights import (
    LayerAttention,
    Shape,
    is_expert,
    is_sharded,
    is_split,
    relocate,
    shard,
    to_hf,
    to_megatron,
    unshard,
)

from .conftest import ROOT, run_cli
from .megatron_parity import parity_batch
from .zygote import torchrun


def _hf_model(kind: str) -> tuple[dict[str, torch.Tensor], Shape, bool]:
    """A small random HF model of each supported family, as its safetensors state dict."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    common = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    if kind == "qwen2":
        model, tied = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True)), True
    elif kind == "qwen3":
        model, tied = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=32, tie_word_embeddings=False)), False
    elif kind == "qwen3_moe":
        moe = Qwen3MoeConfig(
            **common,
            head_dim=32,
            tie_word_embeddings=False,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
        )
        model, tied = Qwen3MoeForCausalLM(moe), False
    elif kind == "gemma3":
        model, tied = gemma3_model(vocab_size=96, num_hidden_layers=2), True
    elif kind == "gemma4":
        model, tied = gemma4_model(vocab_size=96), True
    elif kind == "gemma4_moe":
        model, tied = gemma4_moe_model(vocab_size=96), True
    else:
        model, tied = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False)), False
    if kind == "qwen3_moe":  # the checkpoint layout (per expert), as save_pretrained writes it
        from safetensors.torch import load_file

        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            state = load_file(Path(tmp) / "model.safetensors")
    else:
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if tied:
        state.pop("lm_head.weight", None)  # what save_pretrained writes for a tied model
    head_dim = 32 if kind.startswith("qwen3") else 16
    # Gemma 4's global layer 3: its own head size and KV heads, keys doubling as values
    layers = {3: LayerAttention(groups=1, head_dim=32, values=False)} if kind == "gemma4" else None
    if kind == "gemma4_moe":
        layers = {1: LayerAttention(groups=2, head_dim=32, values=False)}
    shape = Shape(
        heads=4,
        groups=2,
        head_dim=head_dim,
        vocab=96,
        padded_vocab=96,
        sandwich_norms=kind.startswith("gemma"),
        layers=layers,
        moe_block=kind == "gemma4_moe",
    )
    return state, shape, tied


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


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama", "qwen3_moe", "gemma3", "gemma4", "gemma4_moe"])
def test_hf_to_megatron_to_hf_is_bit_identical(kind):
    hf, shape, tied = _hf_model(kind)
    meg = to_megatron(hf, shape, tied)
    if kind == "gemma4_moe":  # the experts' [expert, out, in] tensors split per expert; the router's parts
        stacked = hf["model.layers.1.experts.gate_up_proj"]
        assert torch.equal(
            meg["decoder.layers.1.mlp.moe.experts.local_experts.3.linear_fc1.weight"], stacked[3]
        )
        assert torch.equal(
            meg["decoder.layers.0.mlp.moe.router.per_expert_scale"],
            hf["model.layers.0.router.per_expert_scale"],
        )
        assert torch.equal(
            meg["decoder.layers.0.mlp.linear_fc2.post_layernorm.weight"],
            hf["model.layers.0.post_feedforward_layernorm_1.weight"],
        )
        assert "decoder.layers.0.pre_mlp_layernorm.weight" not in meg  # the block norms its own inputs
        assert is_expert("decoder.layers.1.mlp.moe.experts.local_experts.3.linear_fc1.weight")
        assert relocate("decoder.layers.0.mlp.moe.experts.local_experts.1.linear_fc2.weight", 1, 2) == (
            "decoder.layers.1.mlp.moe.experts.local_experts.3.linear_fc2.weight"
        )
    if kind == "gemma4":  # a global layer without V: [q heads; k] for its one query group
        assert "model.layers.3.self_attn.v_proj.weight" not in hf
        qkv = meg["decoder.layers.3.self_attention.linear_qkv.weight"]
        assert torch.equal(
            qkv,
            torch.cat(
                [hf["model.layers.3.self_attn.q_proj.weight"], hf["model.layers.3.self_attn.k_proj.weight"]]
            ),
        )
        assert qkv.shape == (4 * 32 + 32, 64)
        assert meg["decoder.layers.2.self_attention.linear_qkv.weight"].shape == (2 * (2 + 2) * 16, 64)
        assert torch.equal(meg["decoder.layers.1.layer_scalar"], torch.tensor([0.75]))  # kept as it is
    if kind == "qwen3_moe":  # gate+up fused per expert under its global index; the gate is the router
        fc1 = meg["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"]
        assert torch.equal(
            fc1,
            torch.cat(
                [
                    hf["model.layers.1.mlp.experts.3.gate_proj.weight"],
                    hf["model.layers.1.mlp.experts.3.up_proj.weight"],
                ]
            ),
        )
        assert torch.equal(meg["decoder.layers.0.mlp.router.weight"], hf["model.layers.0.mlp.gate.weight"])
        name = "decoder.layers.2.mlp.experts.local_experts.1.linear_fc2.weight"
        assert relocate("decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight", 2, 0) == name
        assert relocate("decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight", 0, 2).endswith(
            "layers.0.mlp.experts.local_experts.3.linear_fc2.weight"
        )  # expert-parallel rank 1 of 2 holds experts 2 and 3
        # split over expert TP (trainer.expert_tp), not the dense TP group; gate kept with up per rank
        assert not is_sharded(name) and is_split(name)
        gate, up = (hf[f"model.layers.1.mlp.experts.3.{p}_proj.weight"] for p in ("gate", "up"))
        etp1 = shard("decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight", fc1, 2, 1)
        assert torch.equal(etp1, torch.cat([gate.chunk(2)[1], up.chunk(2)[1]]))
    assert "decoder.layers.1.self_attention.linear_qkv.weight" in meg
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in meg) == (
        kind == "qwen2"
    )  # Qwen2 has QKV bias
    if kind == "gemma3":  # the sandwich norms: pre-MLP is Gemma's pre-feedforward norm, the post norms
        # sit on the output projections (Megatron-Bridge's names)
        assert torch.equal(
            meg["decoder.layers.1.pre_mlp_layernorm.weight"],
            hf["model.layers.1.pre_feedforward_layernorm.weight"],
        )
        assert torch.equal(
            meg["decoder.layers.1.self_attention.linear_proj.post_layernorm.weight"],
            hf["model.layers.1.post_attention_layernorm.weight"],
        )
        assert torch.equal(
            meg["decoder.layers.0.mlp.linear_fc2.post_layernorm.weight"],
            hf["model.layers.0.post_feedforward_layernorm.weight"],
        )
        assert not is_sharded("decoder.layers.0.mlp.linear_fc2.post_layernorm.weight")  # replicated over TP
    back = to_hf(meg, shape, tied)
    if tied:
        assert torch.equal(back.pop("lm_head.weight"), hf["model.embed_tokens.weight"])
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_qkv_is_fused_per_query_group():
    """Megatron's layout: [q heads of group 0; k0; v0; q heads of group 1; k1; v1]."""
    hf, shape, tied = _hf_model("llama")
    qkv = to_megatron(hf, shape, tied)["decoder.layers.0.self_attention.linear_qkv.weight"]
    q, k, v = (hf[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    d = shape.head_dim
    assert torch.equal(qkv[: 2 * d], q[: 2 * d])  # group 0's two query heads
    assert torch.equal(qkv[2 * d : 3 * d], k[:d]) and torch.equal(qkv[3 * d : 4 * d], v[:d])
    assert torch.equal(qkv[4 * d : 6 * d], q[2 * d :])  # group 1


@pytest.mark.parametrize("tp", [2, 4])
def test_shard_then_unshard_is_exact_and_fc1_keeps_gate_with_up(tp):
    hf, shape, tied = _hf_model("qwen2")
    meg = to_megatron(hf, shape, tied)
    for name, full in meg.items():
        parts = [shard(name, full, tp, r) for r in range(tp)]
        assert torch.equal(unshard(name, parts), full), name
    fc1 = meg["decoder.layers.0.mlp.linear_fc1.weight"]
    gate = hf["model.layers.0.mlp.gate_proj.weight"]
    rank1 = shard("decoder.layers.0.mlp.linear_fc1.weight", fc1, tp, 1)
    rows = gate.shape[0] // tp
    assert torch.equal(rank1[:rows], gate[rows : 2 * rows])  # rank 1's gate rows, then its up rows


def test_plan_names_a_model_the_backend_cannot_build_and_submit_refuses(tmp_path):
    site = ["cluster.slurm.account=a", "cluster.container.image=i.sqsh"]
    recipe = ["+experiment=dapo-gemma4-e2b-it-1n8g-fsdp2", "trainer=megatron"]  # per-layer embeddings
    plan = run_cli("plan", *recipe, *site)
    assert plan.returncode == 0, plan.stderr
    assert "cannot submit yet" in plan.stdout and "cannot build gemma4_e2b" in plan.stdout
    submitted = run_cli("submit", *recipe, f"run.output_root={tmp_path}", *site)
    assert submitted.returncode == 2
    assert "trainer=megatron cannot build gemma4_e2b yet" in submitted.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written, nothing submitted


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
    """One parity run (tests/megatron_parity.py); ``env``: its HPCRL_PARITY_* switches (a second
    step after the checkpoint, or a resume from one); ``algo``: overrides for either backend."""
    env = {
        **os.environ,
        "HPCRL_PARITY_OVERRIDES": " ".join(
            ((f"trainer.cp={cp}", *extra) if backend == "megatron" else ()) + algo
        ),
        **(env or {}),
    }
    args = [str(model_dir), str(out), str(tp), str(pp), backend]
    script = ROOT / "tests" / "megatron_parity.py"
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


@pytest.mark.slow
def test_tensor_and_pipeline_parallel_match_tp1_and_tp1_matches_fsdp(tiny_dir, tmp_path):
    mask = parity_batch().loss_mask.bool()
    base = _torchrun(tiny_dir, tmp_path / "tp1.pt", 1, 1)
    fsdp = _torchrun(tiny_dir, tmp_path / "fsdp.pt", 1, 1, backend="fsdp")
    assert torch.allclose(base["logp"][mask], fsdp["logp"][mask], atol=1e-5)
    for key in ("loss", "policy_loss", "kl", "entropy", "grad_norm"):
        assert base["metrics"][key] == pytest.approx(fsdp["metrics"][key], rel=1e-4, abs=1e-6), key
    for name, grad in fsdp["grads"].items():
        ours = base["grads"][name if name in base["grads"] else "model.embed_tokens.weight"]
        assert torch.allclose(ours, grad, atol=1e-5), name
    (state_elements,) = base["optimizer_numel"]  # Adam's m and v: two per parameter element
    assert base["state_restored"] == [True]
    assert state_elements == 2 * sum(w.numel() for n, w in base["weights"].items() if n != "lm_head.weight")
    for tp, pp, cp, dp in (
        (2, 1, 1, 1),
        (1, 2, 1, 1),
        (2, 2, 1, 1),
        (1, 1, 1, 2),
        (1, 1, 2, 1),
        (2, 1, 2, 1),
        (1, 2, 2, 1),
    ):
        where = f"TP={tp} PP={pp} CP={cp} DP={dp}"
        port = 29641 + tp * 10 + pp + dp * 3 + cp * 5
        name = f"tp{tp}pp{pp}cp{cp}dp{dp}"
        second = SECOND if name in RESHARDED else None
        run = _torchrun(tiny_dir, tmp_path / f"{name}.pt", tp, pp, port=port, dp=dp, cp=cp, env=second)
        # the layout Megatron really ran: sequence parallel with TP (the default), context parallel
        assert run["layout"]["sequence_parallel"] == (tp > 1) and run["layout"]["cp"] == cp, where
        assert run["state_restored"] == [True] * (tp * pp * cp * dp), where  # checkpoint -> resume, per rank
        if (
            dp * cp > 1 and tp * pp == 1
        ):  # the distributed optimizer: each DP x CP rank holds part of Adam's state
            assert sum(run["optimizer_numel"]) == state_elements, where
            assert max(run["optimizer_numel"]) < 0.75 * state_elements, (where, run["optimizer_numel"])
        _assert_same_step(run, base, mask, where)
    for i, name in enumerate(RESHARDED):
        _assert_resumes_resharded(tiny_dir, tmp_path, name, port=29701 + i)


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant",
    [
        ("algo.policy_loss=gspo", "algo.loss_agg=sequence", "algo.num_minibatches=2"),
        ("algo=drgrpo", "algo.policy_loss=cispo", "algo.eps_low=1", "algo.num_minibatches=2"),
    ],
    ids=["gspo", "cispo-drgrpo"],
)
def test_loss_variants_step_alike_under_megatron_and_fsdp(tiny_dir, tmp_path, variant):
    """The loss variants through both backends' shared step, two optimizer steps (the second
    against the old policy's log-probs) and a sequence-level aggregation: the parity batch's 7 rows
    leave megatron a padded last micro-batch, which must not count as a sequence."""
    mask = parity_batch().loss_mask.bool()
    fsdp = _torchrun(tiny_dir, tmp_path / "fsdp.pt", 1, 1, backend="fsdp", port=29721, algo=variant)
    run = _torchrun(tiny_dir, tmp_path / "tp1.pt", 1, 1, port=29723, algo=variant)
    assert torch.allclose(run["logp"][mask], fsdp["logp"][mask], atol=1e-5)
    for key in ("loss", "policy_loss", "kl", "clip_fraction", "grad_norm"):
        assert run["metrics"][key] == pytest.approx(fsdp["metrics"][key], rel=1e-4, abs=1e-6), key
    # the second minibatch's gradients, and the weights after both steps (fsdp's tied head aside)
    for name, grad in fsdp["grads"].items():
        ours = run["grads"][name if name in run["grads"] else "model.embed_tokens.weight"]
        assert torch.allclose(ours, grad, atol=1e-5), name
    for name, weight in fsdp["weights"].items():
        assert torch.allclose(run["weights"][name], weight, atol=1e-6), name


@pytest.mark.slow
def test_fsdp_checkpoint_of_two_ranks_resumes_on_one(tiny_dir, tmp_path):
    two = _torchrun(tiny_dir, tmp_path / "fsdp2.pt", 1, 1, backend="fsdp", port=29711, dp=2, env=SECOND)
    assert two["state_restored"] == [True, True]  # each rank wrote and read back its own shards
    _assert_resumes_resharded(tiny_dir, tmp_path, "fsdp2", port=29712, backend="fsdp")


SECOND = {"HPCRL_PARITY_SECOND_STEP": "1"}
RESHARDED = ("tp2pp2cp1dp1", "tp1pp1cp1dp2")
"""Layouts whose checkpoint (taken after the first step) a TP=1 run resumes from."""


def _assert_resumes_resharded(
    model_dir: Path, tmp_path: Path, name: str, port: int, backend: str = "megatron"
) -> None:
    """A TP=1 run resumed from ``name``'s checkpoint holds its weights, and its next step equals the
    second step ``name`` took: the Adam state came along (resumed without it, weights-only, the
    step differed by 1.6e-6 from TP2's; with it by 3.7e-9)."""
    saved = torch.load(tmp_path / f"{name}.pt")
    resume = {"HPCRL_PARITY_RESUME": str(tmp_path / f"{name}.ckpt")}
    run = _torchrun(model_dir, tmp_path / f"{name}-as-tp1.pt", 1, 1, backend, port=port, env=resume)
    assert_exports_to(saved["weights"], tmp_path / f"{name}.ckpt", model_dir, backend)  # a tied model
    for key, weight in saved["weights"].items():
        assert torch.equal(run["loaded"][key], weight), (name, key)
        assert torch.allclose(run["weights"][key], saved["second_step"][key], atol=5e-8, rtol=0), (name, key)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """A small random Qwen3 (Q/K norms, untied head) saved as a Hugging Face checkpoint."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    )
    out = tmp_path_factory.mktemp("qwen3")
    Qwen3ForCausalLM(config).save_pretrained(out)
    return out


@pytest.mark.slow
def test_qwen3_qk_norms_match_fsdp_and_under_tensor_parallel(qwen3_dir, tmp_path):
    """Qwen3's Q/K norms are built (they were once silently left out of the layer spec) and their
    gradients, partial per TP rank (each holds some heads), are summed over TP with and without
    sequence parallelism."""
    mask = parity_batch().loss_mask.bool()
    base = _torchrun(qwen3_dir, tmp_path / "tp1.pt", 1, 1, port=29731)
    assert base["layout"]["qk_norms"] == 2  # one per layer
    fsdp = _torchrun(qwen3_dir, tmp_path / "fsdp.pt", 1, 1, backend="fsdp", port=29732)
    assert torch.allclose(base["logp"][mask], fsdp["logp"][mask], atol=1e-5)
    for name, grad in fsdp["grads"].items():
        assert torch.allclose(base["grads"][name], grad, atol=1e-5), name
    for sp in (True, False):
        run = _torchrun(
            qwen3_dir,
            tmp_path / f"tp2sp{sp}.pt",
            2,
            1,
            port=29733 + sp,
            extra=(f"trainer.sequence_parallel={str(sp).lower()}",),
        )
        assert run["layout"]["sequence_parallel"] is sp
        _assert_same_step(run, base, mask, f"TP=2 sequence_parallel={sp}")


def test_spec_helpers_take_both_megatron_core_spec_shapes():
    """0.16 holds sub-specs as ModuleSpec, 0.19 as functools.partial (this machine has 0.16; the GPU
    image 0.19): both are retargeted to another module and built with the same arguments."""
    import functools

    from megatron.core.transformer.spec_utils import ModuleSpec

    from hpcrl.trainer.megatron.spec_utils import build, submodules_of, with_module

    class Slot(torch.nn.Module):
        def __init__(self, config: object, submodules: object = None, **kwargs: object) -> None:
            super().__init__()
            self.config, self.submodules, self.kwargs = config, submodules, kwargs

    class Ours(Slot):
        pass

    for spec in (ModuleSpec(module=Slot, submodules="subs"), functools.partial(Slot, submodules="subs")):
        assert submodules_of(spec) == "subs"
        built = build(with_module(spec, Ours), config="cfg", pg_collection="pg")
        assert type(built) is Ours and built.config == "cfg" and built.submodules == "subs"
        assert built.kwargs == {"pg_collection": "pg"}


def test_sp_norm_marks_its_weight_and_hands_the_next_matmul_its_autocast_dtype():
    from types import SimpleNamespace

    from hpcrl.trainer.megatron.attention import chunk_order
    from hpcrl.trainer.megatron.norms import SPNorm

    norm = SPNorm(SimpleNamespace(sequence_parallel=True), 8, eps=1e-6)
    assert norm.weight.sequence_parallel is True  # summed over TP by the trainer
    x = torch.randn(3, 8)
    plain = torch.nn.functional.rms_norm(x, (8,), norm.weight, 1e-6)
    assert torch.equal(norm(x), plain) and norm(x).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = norm(x)
    # Megatron's SP linear reduce-scatters its input gradient in the input's dtype: it must be bf16
    assert cast.dtype == torch.bfloat16 and torch.equal(cast, plain.to(torch.bfloat16))
    # CP all-gather order: rank r contributes global chunks r and 2cp-1-r
    assert chunk_order(2) == [0, 2, 3, 1]
    assert chunk_order(3) == [0, 2, 4, 5, 3, 1]


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory):
    """A small random Qwen3-MoE (4 experts, top-2, renormalised top-k weights) as a HF checkpoint."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    )
    out = tmp_path_factory.mktemp("qwen3_moe")
    Qwen3MoeForCausalLM(config).save_pretrained(out)
    return out


def assert_exports_to(
    weights: dict[str, torch.Tensor], trainer_dir: Path, model_dir: Path, backend: str = "megatron"
) -> None:
    """``hpcrl export`` of a parity run's checkpoint (every rank's pieces) loads in transformers with
    exactly the trained ``weights``, under the source checkpoint's names and no others."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from hpcrl.run.export import write_export

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


@pytest.mark.slow
def test_qwen3_moe_matches_fsdp_and_expert_parallel_matches_one_rank(qwen3_moe_dir, tmp_path):
    """Router and experts mapped from the checkpoint; EP=2 (tokens exchanged by all-to-all over gloo)
    and EP=2 x PP=2 give the one-rank step. The load-balancing loss is off: the HF model (fsdp) adds
    it only when asked for router logits, so the two backends would differ by it."""
    mask = parity_batch().loss_mask.bool()
    aux_off = ("trainer.moe_aux_loss_coeff=0",)
    base = _torchrun(qwen3_moe_dir, tmp_path / "ep1.pt", 1, 1, port=29741, extra=aux_off)
    assert base["layout"]["experts"] == ["GroupedExperts"]  # grouped GEMMs (experts.py), not Megatron's loop
    fsdp = _torchrun(qwen3_moe_dir, tmp_path / "fsdp.pt", 1, 1, backend="fsdp", port=29742)
    assert torch.allclose(base["logp"][mask], fsdp["logp"][mask], atol=1e-5)
    assert base["metrics"]["grad_norm"] == pytest.approx(fsdp["metrics"]["grad_norm"], rel=1e-5)
    # fsdp's gradients are named as transformers holds them (experts fused): in checkpoint names
    from transformers import AutoModelForCausalLM

    from hpcrl.trainer.fsdp import checkpoint_names

    assert_exports_to(fsdp["weights"], tmp_path / "fsdp.ckpt", qwen3_moe_dir, backend="fsdp")
    hf_grads = checkpoint_names(AutoModelForCausalLM.from_pretrained(qwen3_moe_dir), fsdp["grads"])
    assert hf_grads.keys() == base["grads"].keys()
    for name, grad in hf_grads.items():
        assert torch.allclose(base["grads"][name], grad, atol=1e-5), name
    # EP is carved out of the data-parallel ranks, or (tensor parallel) out of the TP ranks: TP=2 x EP=1
    # keeps every expert on both TP ranks, each routing its own slice of the tokens (sequence parallel),
    # so expert and router gradients are partial per rank and summed
    # (TP=2 x DP=2 with EP=2: each expert on one TP rank of each data-parallel pair). Under context
    # parallel each rank's loss comes multiplied by cp: CP=2 (experts replicated over the CP pair, whose
    # gradients are summed) and EP=2 x CP=2 (the all-to-all already summed both halves) must scale by it.
    # Expert tensor parallel (ETP) splits each expert's fc1/fc2 over its own group, which Megatron
    # carves out of the TP x DP ranks like EP: TP=2 x ETP=2, DP=2 x ETP=2 (one expert split across two
    # data-parallel ranks, each gathering the other's routed tokens), TP=2 x EP=2 x ETP=2 x DP=2.
    layouts = (
        (1, 2, 1, 2, 1, 1),
        (1, 2, 2, 2, 1, 1),
        (2, 1, 1, 1, 1, 1),
        (2, 2, 1, 1, 1, 1),
        (2, 2, 1, 2, 1, 1),
        (1, 1, 1, 1, 2, 1),
        (1, 2, 1, 1, 2, 1),
        (2, 2, 1, 1, 2, 1),
        (2, 1, 1, 1, 1, 2),
        (1, 1, 1, 2, 1, 2),
        (2, 2, 1, 2, 1, 2),
    )
    for i, (tp, ep, pp, dp, cp, etp) in enumerate(layouts):
        where = f"TP={tp} EP={ep} PP={pp} DP={dp} CP={cp} ETP={etp}"
        run = _torchrun(
            qwen3_moe_dir,
            tmp_path / f"tp{tp}ep{ep}pp{pp}dp{dp}cp{cp}etp{etp}.pt",
            tp,
            pp,
            dp=dp,
            cp=cp,
            port=29771 + i,
            extra=(*aux_off, f"trainer.ep={ep}", f"trainer.expert_tp={etp}"),
        )
        assert run["layout"]["sequence_parallel"] == (tp > 1) and run["layout"]["cp"] == cp, where
        assert run["layout"]["expert_tp"] == etp and run["layout"]["expert_fc1_rows"] == [(64 // etp, 64)], (
            where
        )
        _assert_same_step(run, base, mask, where)
        assert all(run["state_restored"]), where
        if (tp, ep, etp, dp) == (2, 2, 2, 2):  # this layout's checkpoint exports to the trained weights
            assert_exports_to(
                run["weights"], tmp_path / f"tp{tp}ep{ep}pp{pp}dp{dp}cp{cp}etp{etp}.ckpt", qwen3_moe_dir
            )
        if tp == 1:  # Adam's state split, never repeated: dense over DP x CP, experts by EP, ETP, expert DP
            assert sum(run["optimizer_numel"]) == sum(base["optimizer_numel"]), (
                where,
                run["optimizer_numel"],
            )


@pytest.mark.slow
def test_grouped_experts_equal_megatrons_loop_and_autocast_per_expert(qwen3_moe_dir, tmp_path):
    """experts.GroupedExperts (two grouped GEMMs over all local experts) on routed tokens with uneven
    counts and an expert that gets none: Megatron's per-expert loop in fp32, and a per-expert F.linear
    loop under bf16 autocast (the cast GPUs take), give its outputs and gradients."""
    out = tmp_path / "experts.pt"
    script = ROOT / "tests" / "megatron_experts_check.py"
    done = torchrun(script, [str(qwen3_moe_dir), str(out)], 1, 29791, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    r = torch.load(out)
    assert r["module"] == "GroupedExperts"
    # the fp32 router (MoE quirk) really gates in fp32 under autocast, and its backward runs
    assert r["router"] == {"module": "Fp32Router", "dtype": "torch.float32", "weight_grad": True}

    def same(a: dict, b: dict, atol: float) -> None:
        assert a["dtype"] == b["dtype"]
        assert torch.allclose(a["out"], b["out"], atol=atol) and torch.allclose(
            a["x_grad"], b["x_grad"], atol=atol
        )
        for name, grad in b["grads"].items():
            assert torch.allclose(a["grads"][name], grad, atol=atol), name

    same(r["grouped fp32"], r["sequential fp32"], 1e-7)
    same(r["grouped fp32"], r["plain fp32"], 1e-7)
    same(r["grouped bf16"], r["plain bf16"], 1e-6)
    assert r["grouped bf16"]["dtype"] == "torch.bfloat16"
    assert not torch.equal(r["grouped bf16"]["out"], r["grouped fp32"]["out"])  # the cast really happened
    empty = r["grouped fp32"]["grads"]["local_experts.1.linear_fc1.weight"]
    assert torch.count_nonzero(empty) == 0  # expert 1 got no token
    assert torch.count_nonzero(r["grouped fp32"]["grads"]["local_experts.2.linear_fc1.weight"]) > 0


def test_moe_plans_with_megatron_under_tensor_context_and_expert_tensor_parallel():
    site = ["cluster.slurm.account=a", "cluster.container.image=i.sqsh", "cluster=h100"]
    # (one H100 node does not fit this model: plan exits 1 but still shows what it found)
    ok = run_cli("plan", "model=qwen3_30b_a3b", "trainer=megatron", "trainer.ep=8", *site)
    assert "EP" in ok.stdout and "cannot submit yet" not in ok.stdout, ok.stdout[-2000:]
    tp2 = run_cli("plan", "model=qwen3_30b_a3b", "trainer=megatron", "trainer.ep=4", "trainer.tp=2", *site)
    assert "EP" in tp2.stdout and "cannot submit yet" not in tp2.stdout, tp2.stdout[-2000:]
    no_sp = run_cli(
        "plan",
        "model=qwen3_30b_a3b",
        "trainer=megatron",
        "trainer.ep=4",
        "trainer.tp=2",
        "trainer.sequence_parallel=false",
        *site,
    )
    assert "under tensor parallel with sequence parallel only" in no_sp.stdout
    cp2 = run_cli("plan", "model=qwen3_30b_a3b", "trainer=megatron", "trainer.ep=4", "trainer.cp=2", *site)
    assert "EP" in cp2.stdout and "cannot submit yet" not in cp2.stdout, cp2.stdout[-2000:]
    etp = run_cli(
        "plan",
        "model=qwen3_30b_a3b",
        "trainer=megatron",
        "trainer.ep=4",
        "trainer.tp=2",
        "trainer.expert_tp=2",
        *site,
    )
    assert "expert TP 2" in etp.stdout, etp.stdout[-2000:]
    assert "cannot submit yet" not in etp.stdout, etp.stdout[-2000:]


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
    trains the same under its own names."""
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
    VLM's text decoder, its logits soft-capped, trains the same under its own names, with TP=2 too."""
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
        where = f"gemma4 {kind} TP={tp} PP={pp} CP={cp}"
        run = _torchrun(
            gemma4_dirs[kind],
            tmp_path / f"{kind}tp{tp}pp{pp}cp{cp}.pt",
            tp,
            pp,
            cp=cp,
            port=29775 + tp + 2 * pp + 4 * cp + 10 * (kind == "vlm"),
        )
        assert run["layout"]["sequence_parallel"] == (tp > 1) and run["layout"]["cp"] == cp, where
        _assert_same_step(run, base[kind], mask, where)
        assert all(run["state_restored"]), where


def test_gemma3_plans_and_renders_with_megatron_on_cpus_and_gpu_clusters(tmp_path):
    # this machine's CPUs (1B does not fit the local 16 GB budget: plan exits 1, but shows no gap)
    local = run_cli("plan", "model=gemma3_1b", "trainer=megatron")
    assert "gemma3" in local.stdout and "cannot submit yet" not in local.stdout, local.stdout[-2000:]
    site = ["cluster.slurm.account=a", "cluster.container.image=i.sqsh", "cluster=b200"]
    plan = run_cli("plan", "model=gemma3_1b", "trainer=megatron", *site)
    assert plan.returncode == 0, plan.stderr
    assert "cannot submit yet" not in plan.stdout and "rollout.block_size=32" in plan.stdout
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
        assert cp2.returncode == 0 and "cannot submit yet" not in cp2.stdout, cp2.stderr[-2000:]


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
    gradient included; EP2, TP2 x EP2 (sequence parallel), PP2 and CP2 give the one-rank step."""
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
        where = f"gemma4 MoE TP={tp} PP={pp} CP={cp} EP={ep}"
        # EP is carved out of the TP x DP ranks: DP = EP where TP x EP ranks run
        run = _torchrun(
            gemma4_moe_dir,
            tmp_path / f"tp{tp}pp{pp}cp{cp}ep{ep}.pt",
            tp,
            pp,
            cp=cp,
            dp=ep,
            port=29793 + tp + 2 * pp + 4 * cp + 8 * ep,
            extra=(*moe, f"trainer.ep={ep}"),
        )
        assert run["layout"]["sequence_parallel"] == (tp > 1) and run["layout"]["cp"] == cp, where
        _assert_same_step(run, base, mask, where)
        assert all(run["state_restored"]), where


def test_gemma4_plans_with_megatron_and_its_variants_beyond_the_dense_decoder_are_refused(tmp_path):
    site = ["cluster.slurm.account=a", "cluster.container.image=i.sqsh"]
    # the shipped recipe: 4 x 8 H100, TP4 x PP2 x DP4 colocated with vLLM, fits in 80 GB
    recipe = ["+experiment=dapo-gemma4-31b-it-4n8g-megatron"]
    plan = run_cli("plan", *recipe, *site)
    assert plan.returncode == 0, plan.stdout[-2000:] + plan.stderr
    # (the table of sibling layouts may list one that cannot submit: this plan's own verdict has the colon)
    assert "cannot submit yet:" not in plan.stdout and "fits: peak" in plan.stdout
    assert "│ train   │ 32   │ 4  │ 2  │ 1  │ 1  │ 4  │" in plan.stdout
    # keys double as values on the 4 global KV heads: TP=8 cannot split them
    tp8 = run_cli("plan", *recipe, "trainer.tp=8", "trainer.pp=1", *site)
    assert "trainer.tp=8 must divide the 4 KV heads of gemma4_31b" in " ".join(tp8.stdout.split())
    # and the 26B-A4B's: TP2 x EP16 on the same 4 x 8 H100
    moe = run_cli("plan", "+experiment=dapo-gemma4-26ba4b-it-4n8g-megatron", *site)
    assert moe.returncode == 0 and "cannot submit yet:" not in moe.stdout, moe.stdout[-2000:]
    assert "│ train   │ 32   │ 2  │ 1  │ 1  │ 16 │ 16 │" in moe.stdout
    for model, what in (("gemma4_e2b", "per-layer embeddings"), ("gemma4_e4b", "KV-shared layers")):
        refused = run_cli("plan", f"model={model}", "trainer=megatron", "cluster=h200", *site)
        assert f"cannot build {model} yet" in refused.stdout and what in " ".join(refused.stdout.split())
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
