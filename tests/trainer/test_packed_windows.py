"""Packed rows on sliding-window layers (``trainer.packing``, Gemma 3's local layers): each query reads
the last ``window`` keys of its own sequence, without an [L, L] mask (``hpcrl/trainer/varlen.py``)."""

from __future__ import annotations

import inspect

import pytest
import torch

from hpcrl.trainer.varlen import RowBounds, attend_packed
from tests.trainer.test_packing import batch, packed_equals_padded

LENGTHS, WINDOW, HEADS, KV, DIM, PAD = [3, 9, 1, 14, 5, 6], 5, 6, 2, 8, 4
"""Sequences shorter than the window, as long, and longer (one by far), 3 query heads a KV head, and
4 positions of padding past the last sequence (megatron's rows at the budget's width)."""


def qkv() -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    width = sum(LENGTHS) + PAD
    return tuple(torch.randn(1, h, width, DIM, generator=gen).requires_grad_() for h in (HEADS, KV, KV))


def each_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """The reference: SDPA over each sequence alone, under the mask written out from the window's
    definition (query i reads keys i - window < j <= i), the outputs side by side, [1, L, H, D]."""
    rep = HEADS // KV
    parts = []
    for qs, ks, vs in zip(*(t.split(LENGTHS, 2) for t in (q, k, v)), strict=True):
        i, j = torch.arange(qs.shape[2])[:, None], torch.arange(qs.shape[2])[None, :]
        reach = (j <= i) & (j > i - window)
        ks, vs = ks.repeat_interleave(rep, 1), vs.repeat_interleave(rep, 1)
        parts.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=reach, scale=0.3))
    return torch.cat(parts, dim=2).transpose(1, 2)


def test_attend_packed_with_a_window_is_masked_sdpa_over_each_sequence():
    """Outputs and input gradients (of a loss on the real tokens) equal the reference's; the padding's
    outputs are 0 and no gradient reaches its keys; without the window (the mutation) the long
    sequences differ; a window as long as the longest sequence (which runs causal) reads what causal
    attention reads."""
    q, k, v = qkv()
    real = sum(LENGTHS)
    row = RowBounds.of(LENGTHS, "cpu")
    out = attend_packed(q, k, v, 0.3, row, WINDOW)
    want = each_sequence(q[:, :, :real], k[:, :, :real], v[:, :, :real], WINDOW)
    assert out.shape == (1, real + PAD, HEADS, DIM)
    assert torch.allclose(out[:, :real], want, atol=1e-5)
    assert not out[:, real:].any()
    got = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected = torch.autograd.grad(want.square().sum(), (q, k, v))
    assert all(torch.allclose(g, w, atol=1e-5) for g, w in zip(got, expected, strict=True))
    assert not got[1][:, :, real:].any()
    causal = attend_packed(q, k, v, 0.3, row)
    assert (causal[:, :real] - want).abs().max() > 0.1
    whole = each_sequence(q[:, :, :real], k[:, :, :real], v[:, :, :real], max(LENGTHS))
    assert torch.allclose(attend_packed(q, k, v, 0.3, row, max(LENGTHS))[:, :real], whole, atol=1e-5)


def test_varlen_kernel_is_asked_for_the_window_in_its_own_count(monkeypatch):
    """The CUDA path (``_flash``) with a stand-in for ``varlen_attn`` (a CUDA kernel: none here) that
    computes what its docstring says: window_size (left, 0) reads the query and the ``left`` keys before
    it, inside each sequence of ``cu``. hpcrl's window of ``w`` keys must arrive as (w - 1, 0), the
    grouped heads with ``enable_gqa``: the stand-in's answer is then the reference's."""
    import torch.nn.attention.varlen as varlen_module

    from hpcrl.trainer import varlen

    calls = []

    def stand_in(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1), enable_gqa=False, scale=None):
        calls.append({"window_size": window_size, "enable_gqa": enable_gqa, "max_q": max_q})
        rep = q.shape[1] // k.shape[1] if enable_gqa else 1
        out = []
        for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True):
            i, j = torch.arange(b - a)[:, None], torch.arange(b - a)[None, :]
            reach = (j <= i) & ((window_size[0] < 0) | (j >= i - window_size[0]))
            qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
            ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
            out.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, reach, scale=scale))
        return torch.cat(out, dim=1).transpose(0, 1)

    monkeypatch.setattr(varlen_module, "varlen_attn", stand_in)
    monkeypatch.setattr(varlen, "_SIGNATURE", [inspect.signature(stand_in)])
    q, k, v = qkv()
    real = sum(LENGTHS)
    q, k, v = (t[:, :, :real] for t in (q, k, v))
    out = varlen._flash(q, k, v, 0.3, RowBounds.of(LENGTHS, "cpu"), WINDOW)
    assert calls == [{"window_size": (WINDOW - 1, 0), "enable_gqa": True, "max_q": max(LENGTHS)}]
    assert torch.allclose(out, each_sequence(q, k, v, WINDOW), atol=1e-5)


def test_flash_is_asked_only_for_heads_it_runs():
    """FlashAttention's forward refuses heads over 256 (Gemma 4's global layers: 512, seen on an H100):
    those go to SDPA per sequence; half-precision heads up to 256 and windows go to the kernel (this
    torch's ``varlen_attn`` takes scale and window); fp32 never does."""
    from hpcrl.trainer.varlen import flash_takes

    assert flash_takes(torch.bfloat16, 256, 0.3, WINDOW)
    assert not flash_takes(torch.bfloat16, 512, 512**-0.5, None)
    assert not flash_takes(torch.float32, 128, None, None)


def test_packed_gemma3_forward_and_gradients_equal_the_padded_ones(monkeypatch):
    """transformers' Gemma 3 (4-token windows on layers 0-2, a global layer 3; tests/megatron/common.py)
    on the fsdp backend's packed forward: the padded forward's log-probs, entropy and gradients at every
    target, sequences of 3 to 11 tokens, and no mask built on the way (transformers' SDPA mask function
    refuses while packed; the unpacked forward still calls it)."""
    from hpcrl.trainer.forward import token_logprobs
    from tests.megatron.common import gemma3_model

    model = gemma3_model().eval()
    b = batch([4, 9, 3, 6, 1], [5, 2, 8, 4, 2])
    packed_equals_padded(model, b, monkeypatch)
    with pytest.raises(AssertionError, match="built an attention mask"):
        token_logprobs(model, b, right_padded=False)


@pytest.mark.parametrize("context", [True, False])
def test_a_packed_row_recomputed_in_the_backward_attends_as_its_forward(context):
    """fsdp's ``trainer.activation_checkpointing`` runs each decoder layer again in the backward, after
    the packed forward has ended: with ``varlen.recompute_context`` (what the fsdp trainer passes) the
    gradients equal the forward kept whole; without it the recompute left the packed row (fails)."""
    from torch.utils.checkpoint import CheckpointError

    from hpcrl.trainer.forward import packed_logprobs
    from hpcrl.trainer.varlen import recompute_context
    from tests.megatron.common import gemma3_model

    torch.manual_seed(0)
    model = gemma3_model().train()  # checkpointing runs in training mode only; the tiny config has no dropout
    b = batch([4, 9, 3, 6, 1], [5, 2, 8, 4, 2])

    def grads():
        model.zero_grad()
        logp, _ = packed_logprobs(model, b)
        (logp * b.loss_mask).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    kept = grads()
    kwargs = {"use_reentrant": False, **({"context_fn": recompute_context} if context else {})}
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if not context:
        with pytest.raises(CheckpointError):
            grads()
        return
    again = grads()
    assert all(torch.allclose(g, w, atol=1e-6) for g, w in zip(again, kept, strict=True))
