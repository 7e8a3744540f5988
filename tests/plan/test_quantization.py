"""``rollout.quantization=fp8``: the planner's memory model and refusals, and what the engine asks vLLM for."""

from __future__ import annotations

import re

import pytest
from rich.console import Console

from hpcrl.errors import ConfigError
from hpcrl.plan.memory import FP8_BLOCK_BYTES
from hpcrl.plan.show import show_plan
from hpcrl.rollout import vllm_compat
from tests.conftest import SITE, compose, plan

GB = 1e9
H200 = ("cluster=h200", *SITE)
FP8 = ("rollout.quantization=fp8", "algo.is_correction=tis")


def test_fp8_engine_weights_count_linears_at_one_byte_hand_computed():
    """Qwen3-8B at rollout.tp=2: embeddings + LM head (2 x 151936 x 4096) stay bf16, every other
    parameter is a linear weight at 1 byte + a float32 scale per 128x128 block."""
    bf16 = plan("model=qwen3_8b", *H200, "rollout.tp=2").memory.rollout
    fp8 = plan("model=qwen3_8b", *H200, "rollout.tp=2", *FP8).memory.rollout
    counts = compose("model=qwen3_8b").model.param_counts()
    embed = 2 * 151936 * 4096
    assert counts.embedding == embed
    linear = counts.total - embed
    assert bf16.weights == pytest.approx(2 * counts.total / 2 / GB)
    assert fp8.weights == pytest.approx((2 * embed + (1 + 4 / 16384) * linear) / 2 / GB)
    assert FP8_BLOCK_BYTES == 1 + 4 / 16384
    assert fp8.quantized and not bf16.quantized
    assert fp8.sequences_that_fit > bf16.sequences_that_fit  # the freed bytes go to the KV cache


def test_plan_shows_the_fp8_engine_weights():
    console = Console(record=True, width=200)
    show_plan(plan("model=qwen3_8b", *H200, *FP8), console)
    text = console.export_text()
    assert re.search(r"rollout: weights \(per GPU, fp8 linears\)\s*│\s*9\.4", text), text


def test_fp8_reads_every_engine_log_prob():
    """The IS correction fp8 requires reads each loss token's engine log-prob: the fraction resolves to 1."""
    assert plan("model=qwen3_8b", *H200, *FP8).cfg.rollout.logprob_fraction == 1.0


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (
            ["model=qwen3_8b", *H200, "rollout.quantization=fp8"],
            "rollout.quantization=fp8 samples from FP8 weights while the trainer scores in BF16: set "
            "algo.is_correction=tis (or icepop)",
        ),
        (
            list(FP8),  # the default local run: this machine's CPU
            "rollout.quantization=fp8 needs GPU vLLM (vLLM-CPU's FP8 kernels need AMX and bf16; hpcrl's CPU "
            "engines run fp32): set rollout.quantization=null on CPUs",
        ),
        (
            ["model=smollm2_135m", *H200, *FP8],
            "rollout.quantization=fp8: smollm2_135m's hidden size (576 per rank at rollout.tp=1) is not a "
            "multiple of 128, FP8's block; use rollout.quantization=null",
        ),
        (
            ["model=qwen2_1p5b", *H200, *FP8, "rollout.tp=4"],
            "rollout.quantization=fp8: qwen2_1p5b's MLP width (2240 per rank at rollout.tp=4) is not a",
        ),
        (
            ["model=gemma3_12b", *H200, *FP8],
            "rollout.quantization=fp8: the vision towers would be quantized too; set "
            "rollout.language_model_only=true",
        ),
        (["rollout.quantization=int8"], "rollout.quantization='int8' must be one of fp8 (or null)"),
        (["rollout=hf", "rollout.quantization=fp8"], "unknown key 'rollout.quantization'"),
    ],
)
def test_fp8_refusals_are_one_line_naming_the_key(overrides, says):
    with pytest.raises(ConfigError) as err:
        plan(*overrides)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_the_engine_asks_vllm_for_block_fp8_with_routers_left_alone():
    assert vllm_compat.quantization_kwargs(None, on_cpu=True) == {}
    kwargs = vllm_compat.quantization_kwargs("fp8", on_cpu=False)
    assert kwargs["quantization"] == "fp8_per_block"
    (router,) = kwargs["quantization_config"]["ignore"]
    pattern = re.compile(router.removeprefix("re:"))
    assert pattern.match("model.layers.3.mlp.gate")
    for layer in (
        "model.layers.3.mlp.gate_up_proj",
        "model.layers.3.mlp.experts",
        "model.layers.3.self_attn.qkv_proj",
    ):
        assert not pattern.match(layer)
    with pytest.raises(ConfigError, match=r"^rollout.quantization=fp8 needs GPU vLLM"):
        vllm_compat.quantization_kwargs("fp8", on_cpu=True)
