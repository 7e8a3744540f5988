"""The Megatron family table (hpcrl/trainer/megatron/families/table.py) against the torch-free names the
planner reads (trainer.config: ``MEGATRON_FAMILIES``, ``megatron_family``), and the table as the only
way to a family module; a few hooks against what each family's Hugging Face decoder has."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

from hpcrl.trainer.config import MEGATRON_FAMILIES, MegatronTrainerConfig, megatron_family
from hpcrl.trainer.megatron.families.table import FAMILIES

PKG = Path(__file__).resolve().parents[2] / "hpcrl"
FAMILY_DIR = PKG / "trainer" / "megatron" / "families"
NOT_A_FAMILY = {"__init__", "base", "table"}


def test_the_planners_names_are_the_tables_keys():
    assert list(FAMILIES) == list(MEGATRON_FAMILIES), (
        "trainer.config.MEGATRON_FAMILIES (read by the planner) and families/table.py's FAMILIES must "
        "name the same families in the same order"
    )


def test_every_family_reads_its_own_model_types():
    for name, cls in FAMILIES.items():
        assert cls.model_types, f"{cls.__name__} names no Hugging Face model_type"
        for model_type in cls.model_types:
            assert megatron_family(model_type) == name, (
                f"{cls.__name__} reads model_type {model_type!r}, which megatron_family maps to "
                f"{megatron_family(model_type)!r}, not {name!r}"
            )


def _hpcrl_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return {m for m in found if m.startswith("hpcrl.")}


def test_family_modules_are_reached_only_through_the_table():
    modules = {p.stem for p in FAMILY_DIR.glob("*.py")} - NOT_A_FAMILY
    family_modules = {f"hpcrl.trainer.megatron.families.{m}" for m in modules}
    table = FAMILY_DIR / "table.py"
    assert family_modules <= _hpcrl_imports(table), "families/table.py imports every family module"
    offenders = {
        str(path.relative_to(PKG.parent)): sorted(hits)
        for path in sorted(PKG.rglob("*.py"))
        if path != table and (hits := _hpcrl_imports(path) & family_modules)
    }
    assert not offenders, f"family modules imported outside families/table.py: {offenders}"
    defined = {cls.__module__ for cls in FAMILIES.values()}
    assert defined == family_modules, "every family module holds a family of the table"


def _hf(model_type: str, **fields: object) -> SimpleNamespace:
    shape = dict(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
    )
    return SimpleNamespace(model_type=model_type, **{**shape, **fields})


def _fields(name: str, **hf_fields: object) -> dict[str, object]:
    """The family's TransformerConfig fields, its MoE ones included."""
    hf = _hf(name, **hf_fields)
    family = FAMILIES[name](hf)
    return {**family.config_fields(hf), **family.moe_fields(hf, MegatronTrainerConfig())}


def test_hooks_say_what_each_hugging_face_decoder_has():
    """The fields the former ``model_type`` branches set: Qwen2's Q/K/V biases (always, as HF's
    Qwen2Attention), Llama's only where ``attention_bias`` says, Qwen3's Q/K norms, Qwen3-MoE's experts
    and routing (softmax before top-k unless the top-k weights are renormalised)."""
    plain = {name: _fields(name) for name in ("qwen2", "qwen3", "llama")}
    assert [name for name, f in plain.items() if f["add_qkv_bias"]] == ["qwen2"]
    assert [name for name, f in plain.items() if f["qk_layernorm"]] == ["qwen3"]
    assert not any("num_moe_experts" in f for f in plain.values())
    assert _fields("llama", attention_bias=True)["add_qkv_bias"] is True
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    routed = _fields("qwen3_moe", **moe)
    assert routed["qk_layernorm"] is True
    assert routed["num_moe_experts"] == 8 and routed["moe_router_topk"] == 2
    assert routed["moe_router_pre_softmax"] is True
    assert _fields("qwen3_moe", **moe, norm_topk_prob=True)["moe_router_pre_softmax"] is False
    with pytest.raises(ValueError, match="an MoE in every layer"):
        _fields("qwen3_moe", **moe, decoder_sparse_step=2)
