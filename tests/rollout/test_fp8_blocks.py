"""What ``rollout.quantization=fp8`` does to each linear weight on the engine: vLLM's
``per_block_cast_to_fp8`` (the online ``fp8_per_block`` method's quantizer; the same code in GPU vLLM
0.26 and the CPU build), checked here on CPU: the error bound, block shapes and fused shards."""

from __future__ import annotations

import pytest
import torch

E4M3_MAX = 448.0


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    return per_block_cast_to_fp8(w, block_size=[128, 128], use_ue8m0=False)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[: q.shape[0], : q.shape[1]]
    return q.float() * full


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (96, 1000)])
def test_round_trip_is_within_e4m3_rounding_of_each_block(shape):
    """e4m3 keeps 3 mantissa bits: a normal value is off by at most 1/16 of itself, a subnormal one
    by half its spacing (2^-10 of the block's scale); each block's largest value maps to 448. Dims not
    divisible by 128 get partial blocks at the edge: ceil(m/128) x ceil(n/128) scales."""
    torch.manual_seed(0)
    w = torch.randn(shape, dtype=torch.bfloat16) * torch.logspace(-3, 0, shape[1])  # blocks of other ranges
    q, scale = quantize(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[: shape[0], : shape[1]]
    err = (dequantize(q, scale) - w.float()).abs()
    assert (err <= w.float().abs() / 16 + full / 1024 + 1e-12).all()
    block_max = w.float().abs().amax(1).view(-1, 1)[:128].max()  # the first block row's top value
    assert dequantize(q, scale)[:128].abs().max() == pytest.approx(block_max.item(), rel=1 / 16)
    assert q.float().abs().max().item() == E4M3_MAX


def test_fused_shards_quantize_as_their_parts_when_widths_are_blocks():
    """A fused q/k/v (or gate/up) weight whose shard heights are multiples of 128 (what the planner asks
    of each TP rank) quantizes exactly as its shards one by one: no block straddles two shards."""
    torch.manual_seed(1)
    q_, k_, v_ = (
        torch.randn(rows, 256, dtype=torch.bfloat16) * s for rows, s in ((512, 1), (128, 30), (128, 0.01))
    )
    fused, fused_scale = quantize(torch.cat([q_, k_, v_]))
    parts = [quantize(t) for t in (q_, k_, v_)]
    assert torch.equal(fused.float(), torch.cat([p[0] for p in parts]).float())
    assert torch.equal(fused_scale, torch.cat([p[1] for p in parts]))


def test_moe_experts_quantize_one_by_one():
    """Stacked experts [E, out, in]: each expert its own blocks (vLLM's online MoE method loops over
    experts); a block never spans two experts."""
    torch.manual_seed(2)
    experts = torch.randn(4, 256, 128, dtype=torch.bfloat16) * torch.tensor([1, 10, 0.1, 100]).view(4, 1, 1)
    for e in range(4):
        q, scale = quantize(experts[e])
        assert scale.shape == (2, 1)
        assert scale.max() <= experts[e].float().abs().max() / E4M3_MAX * (1 + 1e-6)
        assert (
            (dequantize(q, scale) - experts[e].float()).abs()
            <= experts[e].float().abs() / 16 + scale.max() / 1024
        ).all()
