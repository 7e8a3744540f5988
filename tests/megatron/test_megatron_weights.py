"""Megatron-core backend: HF<->Megatron weight mapping (exact round trips, Qwen3-MoE, Gemma 3 and
Gemma 4 too), the fused QKV, sharding by hand, and the plan naming a model the backend cannot build."""

from __future__ import annotations

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
from tests.conftest import JOB_DOWNLOADS, run_cli
from tests.megatron.common import (
    gemma3_model,
    gemma4_model,
    gemma4_moe_model,
)


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
    site = ["cluster.slurm.account=a", "cluster.container.image=i.sqsh", *JOB_DOWNLOADS]
    recipe = ["+experiment=dapo-gemma4-e2b-it-1n8g-fsdp2", "trainer=megatron"]  # per-layer embeddings
    plan = run_cli("plan", *recipe, *site)
    assert plan.returncode == 2 and "Memory per GPU" in plan.stdout, (
        plan.stderr
    )  # the tables, then the refusal
    assert plan.stderr.startswith("hpcrl: error: trainer=megatron cannot build gemma4_e2b yet"), plan.stderr
    submitted = run_cli("submit", *recipe, f"run.output_root={tmp_path}", *site)
    assert submitted.returncode == 2 and submitted.stderr == plan.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written, nothing submitted
