"""Transformer Engine in the megatron backend, what runs without it (issue 36 item 5): which layers a
build takes (spec.uses_local_spec: TE only where it imports and the model is on CUDA), TE's grouped
experts' names (``experts.linear_fc1.weight<j>``) mapped to SequentialMLP's at one boundary
(weights.expert_name) through EP relocation, expert-TP cuts, checkpoint keys and back to Hugging Face,
and bench/te_gpu.py on a CPU (its local side through the real trainer, its --help)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hpcrl.core.parallel import TrainParallel
from hpcrl.trainer.megatron import spec, weights_hybrid
from hpcrl.trainer.megatron.placement import Placement
from hpcrl.trainer.megatron.sharded import Pieces
from hpcrl.trainer.megatron.weights import (
    expert_name,
    is_expert,
    is_split,
    shard,
    to_hf,
    to_megatron,
    unshard,
)
from tests.megatron.test_megatron_nemotron_h import _checkpoint, _shape, nemotron_h_config
from tests.megatron.test_megatron_weights import _hf_model

ROOT = Path(__file__).resolve().parents[2]
TE_EXPERT = re.compile(
    r"^(decoder\.layers\.\d+\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.weight$"
)


def te_local(name: str, experts_per_rank: int) -> tuple[int, str]:
    """(EP rank, the name TE's grouped experts give ``name`` on that rank): the inverse of
    weights.expert_name after relocation, written out here as TEGroupedMLP names its parameters."""
    m = TE_EXPERT.match(name)
    assert m is not None, name
    e = int(m.group(2))
    return e // experts_per_rank, f"{m.group(1)}{m.group(3)}.weight{e % experts_per_rank}"


# -- which layers ---------------------------------------------------------------------------------------
def qwen3_family() -> object:
    from transformers import Qwen3Config

    return spec.family_of(Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2))


def gemma3_family() -> object:
    from transformers import Gemma3TextConfig

    return spec.family_of(Gemma3TextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2))


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:1"])
def test_without_transformer_engine_every_build_is_local(monkeypatch, device):
    monkeypatch.setattr(spec, "have_transformer_engine", lambda: False)
    assert spec.uses_local_spec(spec.family_of(nemotron_h_config()), device)


def test_with_transformer_engine_a_cpu_model_stays_local(monkeypatch):
    monkeypatch.setattr(spec, "have_transformer_engine", lambda: True)  # as on a TE site, model on the CPU
    assert spec.uses_local_spec(spec.family_of(nemotron_h_config()), "cpu")


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_with_transformer_engine_a_gpu_nemotron_h_takes_te(monkeypatch, device):
    monkeypatch.setattr(spec, "have_transformer_engine", lambda: True)
    assert not spec.uses_local_spec(spec.family_of(nemotron_h_config()), device)


def test_with_transformer_engine_a_local_only_family_stays_local(monkeypatch):
    monkeypatch.setattr(spec, "have_transformer_engine", lambda: True)
    assert spec.uses_local_spec(gemma3_family(), "cuda")


def test_nemotron_h_te_build_keeps_sdpa_and_unfused_norms_gpt_te_fuses_them():
    nemotron = spec.family_of(nemotron_h_config())
    assert not spec.folds_norms(nemotron, True)
    assert spec.folds_norms(qwen3_family(), True)
    assert not spec.folds_norms(qwen3_family(), False)


def test_a_gpt_te_build_attends_with_hpcrls_attention(monkeypatch):
    """TE's GPT spec with its core attention swapped for SDPAttention (packing and CP attend one way);
    megatron-core's TE spec is answered with its local one here (no TE on this host): the slot is what
    is checked."""
    from types import SimpleNamespace

    from megatron.core.models.gpt import gpt_layer_specs as specs

    from hpcrl.trainer.megatron.attention import SDPAttention

    monkeypatch.setattr(
        specs,
        "get_gpt_layer_with_transformer_engine_spec",
        lambda num_experts, qk_layernorm, moe_grouped_gemm: specs.get_gpt_layer_local_spec(
            num_experts=num_experts, qk_layernorm=qk_layernorm
        ),
    )
    config = SimpleNamespace(num_moe_experts=None, qk_layernorm=True)
    built = spec.layer_spec(config, qwen3_family(), te=True)
    assert built.submodules.self_attention.submodules.core_attention is SDPAttention


def test_the_startup_line_names_the_layers():
    nemotron = spec.family_of(nemotron_h_config())
    assert "grouped GEMM" in spec.describe_layers(nemotron, True)
    assert "SDPA attention" in spec.describe_layers(nemotron, True)
    assert spec.describe_layers(nemotron, False).startswith("megatron local spec")


# -- TE's grouped expert names ----------------------------------------------------------------------------
def test_expert_name_maps_te_grouped_weights_only():
    assert (
        expert_name("decoder.layers.4.mlp.experts.linear_fc2.weight11")
        == "decoder.layers.4.mlp.experts.local_experts.11.linear_fc2.weight"
    )
    shared = "decoder.layers.4.mlp.shared_experts.linear_fc1.weight"  # TE linears, one tensor: unchanged
    assert expert_name(shared) == shared
    assert not is_expert(shared)
    assert is_expert("decoder.layers.4.mlp.experts.linear_fc1.weight0")
    assert is_split("decoder.layers.4.mlp.experts.linear_fc1.weight0")


@pytest.mark.parametrize("ep,expert_tp", [(1, 1), (2, 1), (2, 2), (1, 2)])
def test_nemotron_h_te_expert_names_round_trip_through_ep_and_expert_tp(tmp_path, ep, expert_tp):
    """HF -> Megatron (SequentialMLP names) -> each EP rank's TE names and expert-TP slices (squared
    ReLU: fc1 one part) -> relocated, gathered -> HF: bit-identical; checkpoint keys as the local build's."""
    hf, shape = _checkpoint(tmp_path), _shape()
    meg = weights_hybrid.to_megatron(hf, shape, tied=False)
    per_rank = 8 // ep
    par = TrainParallel(world=ep * expert_tp, ep=ep, expert_tp=expert_tp)
    parts = weights_hybrid.partitions(shape)
    back: dict[str, torch.Tensor] = {}
    for name, full in meg.items():
        if ".local_experts." not in name:
            back[name] = full
            continue
        rank, local = te_local(name, per_rank)
        placement = Placement(par, 0, rank * per_rank, (), parts)
        assert placement.global_name(local) == name
        assert Pieces(placement, shape.vocab, False).key(local) == name  # the same checkpoint key
        slices = [shard(local, full, expert_tp, r, placement.parts_of(local)) for r in range(expert_tp)]
        if expert_tp > 1 and local.endswith(tuple(f"linear_fc1.weight{j}" for j in range(per_rank))):
            assert torch.equal(slices[0], full.chunk(expert_tp)[0])  # one part: no gate/up halves
        back[placement.global_name(local)] = unshard(local, slices, placement.parts_of(local))
    out = weights_hybrid.to_hf(back, shape, tied=False)
    assert out.keys() == hf.keys()
    assert all(torch.equal(out[k], hf[k]) for k in hf)


@pytest.mark.parametrize("ep,expert_tp", [(2, 1), (1, 2), (2, 2)])
def test_qwen3_moe_te_expert_names_keep_gate_with_up_through_expert_tp(ep, expert_tp):
    hf, shape, tied = _hf_model("qwen3_moe")  # 4 experts, per-expert checkpoint layout
    meg = to_megatron(hf, shape, tied)
    per_rank = 4 // ep
    par = TrainParallel(world=ep * expert_tp, ep=ep, expert_tp=expert_tp)
    back: dict[str, torch.Tensor] = {}
    for name, full in meg.items():
        if ".local_experts." not in name:
            back[name] = full
            continue
        rank, local = te_local(name, per_rank)
        placement = Placement(par, 0, rank * per_rank, (), {})
        slices = [shard(local, full, expert_tp, r) for r in range(expert_tp)]
        if local.endswith("linear_fc1.weight0") and expert_tp > 1:  # rank 0: its gate rows, then its up rows
            gate, up = full.chunk(2)
            assert torch.equal(slices[0], torch.cat([gate.chunk(expert_tp)[0], up.chunk(expert_tp)[0]]))
        back[placement.global_name(local)] = unshard(local, slices)
    out = to_hf(back, shape, tied)
    assert out.keys() == hf.keys()
    assert all(torch.equal(out[k], hf[k]) for k in hf)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_te_gpt_spec_norm_names_round_trip(kind):
    """TE's GPT spec fuses the pre-attention norm into linear_qkv, and a dense layer's pre-MLP norm
    into linear_fc1; an MoE layer keeps its pre-MLP norm apart (its fc1 is the grouped experts')."""
    hf, shape, tied = _hf_model(kind)
    te_shape = replace(shape, fused_norms=True, moe=kind == "qwen3_moe")
    meg = to_megatron(hf, te_shape, tied)
    assert "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight" in meg
    mlp_norm = "pre_mlp_layernorm.weight" if kind == "qwen3_moe" else "mlp.linear_fc1.layer_norm_weight"
    assert f"decoder.layers.1.{mlp_norm}" in meg
    back = to_hf(meg, te_shape, tied)
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[k], hf[k]) for k in hf)


# -- the GPU script on a CPU ----------------------------------------------------------------------------
def test_te_gpu_script_help_runs_without_transformer_engine():
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench/te_gpu.py"), "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--parity" in done.stdout


def test_te_gpu_parity_local_side_round_trips_on_cpu(tmp_path):
    """The script's local side through the real trainer on a CPU (TE has no CPU kernels): the export
    equals the checkpoint, and the experts are hpcrl's GroupedExperts."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    args = ["--parity", "--device", "cpu", "--precisions", "float32", "--cases", "qwen3_moe"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench/te_gpu.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads((tmp_path / "te_gpu.json").read_text())["parity"]["qwen3_moe float32"]["local only"]
    assert row["round_trip"]["equal"], row["round_trip"]
    assert row["experts"] == ["GroupedExperts"]
    assert "[hpcrl] trainer=megatron layers on cpu: megatron local spec" in done.stderr  # the startup line
