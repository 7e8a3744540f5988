"""Sequence packing (``trainer.packing``): the bins, the packed row and its way back, the same
log-probs as the padded forward on a real model, the same step, and the plan's checks."""

from __future__ import annotations

import pytest
import torch

from hpcrl.errors import ConfigError
from hpcrl.trainer.batch import build_batch
from hpcrl.trainer.forward import packed_logprobs, token_logprobs
from hpcrl.trainer.packing import Packed, pack_rows
from tests.conftest import SITE, compose, plan


def test_first_fit_decreasing_bins_hold_every_row_once_within_the_budget():
    lengths = [900, 120, 130, 500, 480, 60, 2000, 40]
    bins = pack_rows(lengths, 1024)
    assert sorted(r for b in bins for r in b) == list(range(len(lengths)))
    # the one row over the budget has a bin of its own; every other bin fits
    assert [6] in bins
    assert all(sum(lengths[r] for r in b) <= 1024 for b in bins if b != [6])
    # 4,230 tokens in bins of 1,024 (one oversize row alone): FFD needs 4 here, rows 1,024 apart need 8
    assert len(bins) == 4


def batch(lengths_p: list[int], lengths_c: list[int]):
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 60, (n,), generator=gen).tolist() for n in lengths_p]
    comps = [torch.randint(3, 60, (n,), generator=gen).tolist() for n in lengths_c]
    lps = [[-1.0] * n for n in lengths_c]
    adv = torch.linspace(-1, 1, len(prompts)).tolist()
    return build_batch(prompts, comps, lps, adv, keep=[1] * len(prompts), pad_id=0)


def test_packed_row_goes_back_to_the_padded_rows():
    b = batch([3, 5, 2], [4, 1, 6])
    packed = Packed.of(b.input_ids, b.attention_mask)
    assert packed.ids.shape == (1, 7 + 6 + 8)
    assert packed.positions[0].tolist() == [*range(7), *range(6), *range(8)]
    # each position's target is the next token of its own sequence; a sequence's last predicts nothing
    back = packed.unpack(packed.targets.float(), b.input_ids.shape[1] - 1)
    expected = torch.where(b.attention_mask[:, 1:].bool(), b.input_ids[:, 1:], 0).float()
    assert torch.equal(back, expected)


@pytest.mark.slow
def test_packed_forward_and_gradients_equal_the_padded_ones_on_a_real_model(tiny_dir, monkeypatch):
    """Attention stays inside each packed sequence (a leak across a restart would change the later
    sequences' log-probs by far more than the tolerance), the gradients are the padded step's, and no
    [L, L] mask is built on the way (transformers' SDPA mask function is refused while packed)."""
    from hpcrl.trainer.hf_load import meta_model

    model = meta_model(tiny_dir).to_empty(device="cpu")
    torch.manual_seed(0)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    model.eval()
    b = batch([4, 9, 3, 6], [5, 2, 8, 4])
    pad = ~b.attention_mask[:, 1:].bool()

    packed = packed_equals_padded(model, b, monkeypatch)
    for got in packed[:2]:
        assert not got[pad].any()
    with pytest.raises(AssertionError, match="built an attention mask"):  # unpacked forwards still mask
        token_logprobs(model, b, right_padded=False)


def test_packed_attention_is_the_block_causal_masked_attention():
    """The registered function inside ``packed_attention`` against SDPA under the dense block-causal
    mask (``Packed.attention_mask``), grouped heads, outputs and input gradients; outside the block it is
    transformers' SDPA over the whole row (the mutation: attention across the restarts)."""
    from types import SimpleNamespace

    from hpcrl.trainer.varlen import packed_attention, packed_sdpa, use_packed_attention

    lengths, heads, kv, dim = [5, 1, 12, 7], 6, 2, 8
    gen = torch.Generator().manual_seed(0)
    n = sum(lengths)
    q, k, v = (torch.randn(1, h, n, dim, generator=gen).requires_grad_() for h in (heads, kv, kv))
    positions = torch.cat([torch.arange(m) for m in lengths])[None]
    layer = SimpleNamespace(num_key_value_groups=heads // kv, is_causal=True, training=False)
    with packed_attention(positions):
        out, _ = packed_sdpa(layer, q, k, v, None, scaling=0.3)
    got = torch.autograd.grad(out.square().sum(), (q, k, v))
    allowed = ~Packed(positions, positions, positions, [], []).attention_mask()[0]
    rep = heads // kv
    want_out = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=allowed, scale=0.3
    ).transpose(1, 2)
    want = torch.autograd.grad(want_out.square().sum(), (q, k, v))
    assert torch.allclose(out, want_out, atol=1e-5)
    assert all(torch.allclose(g, w, atol=1e-5) for g, w in zip(got, want, strict=True))
    whole, _ = packed_sdpa(layer, q, k, v, None, scaling=0.3)  # no packed row: one causal sequence
    assert (whole - want_out).abs().max() > 0.1
    from transformers import Gemma3TextConfig

    gemma = Gemma3TextConfig(num_hidden_layers=6)  # sliding-window layers pack too (their own windows)
    gemma._attn_implementation = "sdpa"
    assert use_packed_attention(SimpleNamespace(config=gemma))
    both_ways = Gemma3TextConfig(num_hidden_layers=6, use_bidirectional_attention=True)
    both_ways._attn_implementation = "sdpa"  # attention both ways: transformers' mask stays
    assert not use_packed_attention(SimpleNamespace(config=both_ways))
    assert both_ways._attn_implementation == "sdpa"


def test_megatron_attention_of_a_packed_row_reads_its_bounds_not_a_mask():
    """megatron's ``SDPAttention`` given a packed row's ``packed_seq_params`` (the pipeline's
    ``seq_params``: sequences of 5, 1, 12 and 7 tokens, then 3 of padding) and no mask: the outputs and
    input gradients of the same layer under the row's dense block mask at every real token, grouped
    heads (the mutation: one causal sequence over the whole row); the padding attends nowhere (0); a
    sliding-window layer (4 keys) the same under the block mask and its window. A mask is refused (no
    path reads one; context parallel's packed rows: tests/trainer/test_packed_cp.py); the params keep
    the real tokens' end for the Mamba mixers and the width for RoPE."""
    from types import SimpleNamespace

    from hpcrl.trainer.context_parallel import sdpa, window_mask
    from hpcrl.trainer.megatron.attention import SDPAttention
    from hpcrl.trainer.megatron.pipeline import seq_params

    lengths, heads, kv, dim, width = [5, 1, 12, 7], 6, 2, 8, 28
    rows = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]
    packed = Packed.of(rows.masked_fill(mask, 7), mask.long()).padded(width)
    params = seq_params(packed)
    assert params.cu_seqlens_q.tolist() == [0, 5, 6, 18, 25] and params.max_seqlen_q == width
    assert params.hpcrl_row.lengths == lengths
    config = SimpleNamespace(
        attention_dropout=0.0, context_parallel_size=1, window_size=None, window_attn_skip_freq=None
    )
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(width, 1, h, dim, generator=gen).requires_grad_() for h in (heads, kv, kv))

    def grads(out):  # the input gradients of a loss on the real tokens' outputs
        return torch.autograd.grad(out[:25].square().sum(), (q, k, v))

    allowed = ~packed.attention_mask()[0, 0]
    for window in (None, 4):
        cfg = SimpleNamespace(**{**vars(config), "window_size": window and (window - 1, 0)})
        layer = SDPAttention(cfg, layer_number=1, attn_mask_type=None, softmax_scale=0.3)
        out = layer(q, k, v, None, packed_seq_params=params)
        reach = allowed if window is None else allowed & window_mask(width, window, q.device)
        want = sdpa(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), reach, scale=0.3).permute(2, 0, 1, 3)
        want = want.flatten(2)
        assert out.shape == (width, 1, heads * dim)
        assert torch.allclose(out[:25], want[:25], atol=1e-5)
        assert all(torch.allclose(g, w, atol=1e-5) for g, w in zip(grads(out), grads(want), strict=True))
        assert not out[25:].any()
        assert (layer(q, k, v, None)[:25] - want[:25]).abs().max() > 0.1, window
    with pytest.raises(ValueError, match="SDPAttention reads no mask"):
        layer(q, k, v, packed.attention_mask(), packed_seq_params=params)


def test_the_plan_counts_the_budget_and_refuses_what_cannot_pack():
    base = ("trainer.micro_batch_size=2",)
    padded = plan(*base).memory.train.activations
    same = plan(*base, "trainer.packing=true")
    double = plan(*base, "trainer.packing=true", f"trainer.micro_batch_tokens={4 * compose().max_seq_len}")
    assert same.memory.train.activations == pytest.approx(padded)  # the padded micro-batch's memory
    assert same.cfg.trainer.micro_batch_tokens == 2 * same.cfg.max_seq_len  # resolved for the job
    assert any(line.startswith("trainer.micro_batch_tokens=") for line in same.engine_defaults)
    assert double.memory.train.activations > 1.5 * padded
    with pytest.raises(ConfigError, match=r"trainer.micro_batch_tokens is the budget of a packed"):
        compose("trainer.micro_batch_tokens=4096").trainer.check()
    with pytest.raises(ConfigError, match=r"micro_batch_tokens=8 is below the longest sequence"):
        plan("trainer.packing=true", "trainer.micro_batch_tokens=8")
    assert plan("trainer=megatron", "trainer.packing=true").cfg.trainer.packing  # both backends pack
    nemotron_h = "+experiment=grpo-tinynemotronh-1n1g-fsdp"  # Mamba layers pack too (they restart)
    assert plan(nemotron_h, "trainer.packing=true", "trainer.micro_batch_tokens=48").cfg.trainer.packing
    over_cp = ("trainer.packing=true", "trainer.cp=2", "cluster=h100", *SITE)
    assert plan("trainer=megatron", *over_cp).cfg.trainer.cp == 2  # megatron splits packed rows over CP
    with pytest.raises(ConfigError, match=r"fsdp backend does not split packed rows over context parallel"):
        plan("trainer=fsdp", *over_cp)
    # megatron packs under CP with EP x expert TP too (the recipe packs: its tiny build's step)
    super_cp_ep = plan("+experiment=dapo-nemotron-super-5n4g-megatron-tp4cp4ep4etp4", *SITE)
    assert super_cp_ep.cfg.trainer.packing
    assert (super_cp_ep.cfg.trainer.cp, super_cp_ep.cfg.trainer.ep) == (4, 4)


def test_mamba_conv_and_scan_restart_at_each_packed_sequence():
    """trainer/ssd.py on a row of six sequences (chunks of 4: sequences start mid-chunk, end mid-chunk,
    span chunks, one is a single token): each sequence's conv output, scan output and input gradients
    are those of the sequence alone; the same row without ``seq_idx`` mixes them (the mutation)."""
    from hpcrl.trainer.ssd import causal_conv, seq_index, ssd_scan

    lengths, heads, groups = [5, 11, 3, 9, 1, 7], 4, 2
    gen = torch.Generator().manual_seed(0)
    n = sum(lengths)
    x, dt = torch.randn(1, n, heads, 3, generator=gen), torch.rand(1, n, heads, generator=gen)
    b, c = torch.randn(1, n, groups, 5, generator=gen), torch.randn(1, n, groups, 5, generator=gen)
    a = -torch.rand(heads, generator=gen) - 0.5
    seq_idx = seq_index(torch.cat([torch.arange(k) for k in lengths])[None])
    assert seq_idx[0].tolist() == [i for i, k in enumerate(lengths) for _ in range(k)]
    cuts = torch.tensor(lengths).cumsum(0)[:-1].tolist()

    def alone(f, t, dim):  # each sequence on its own, the outputs side by side
        return torch.cat([f(part) for part in t.tensor_split(cuts, dim=dim)], dim=dim)

    x.requires_grad_()
    packed = ssd_scan(x, dt, a, b, c, 4, seq_idx)
    (grad,) = torch.autograd.grad((packed * packed.detach().sign()).sum(), x)
    xs = x.detach().tensor_split(cuts, dim=1)
    parts = [ssd_scan(p.requires_grad_(), d, a, bb, cc, 4) for p, d, bb, cc in zip(
        xs, dt.tensor_split(cuts, dim=1), b.tensor_split(cuts, dim=1), c.tensor_split(cuts, dim=1), strict=True
    )]  # fmt: skip
    want = torch.cat(parts, dim=1)
    want_grad = torch.cat(torch.autograd.grad((want * want.detach().sign()).sum(), xs), dim=1)
    assert torch.allclose(packed, want, atol=1e-5) and torch.allclose(grad, want_grad, atol=1e-5)
    assert (ssd_scan(x, dt, a, b, c, 4) - want).abs().max() > 0.1
    signal, weight, bias = torch.randn(1, 6, n, generator=gen), torch.randn(6, 1, 4), torch.randn(6)
    conv = causal_conv(signal, weight, bias, seq_idx)
    assert torch.allclose(conv, alone(lambda s: causal_conv(s, weight, bias), signal, 2), atol=1e-6)
    assert not torch.allclose(causal_conv(signal, weight, bias), conv, atol=0.1)


def nemotron_h() -> torch.nn.Module:
    """A random Nemotron-H of Super's kinds (tests/harness/tiny_checkpoints.py), chunks of 8; dt biases
    spread so that some heads remember far back (a state carried over a restart shows)."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    from tests.harness.tiny_checkpoints import NEMOTRON_H

    torch.manual_seed(0)
    config = NemotronHConfig(
        **{**NEMOTRON_H, "hybrid_override_pattern": "MEM*M", "tie_word_embeddings": False}
    )
    model = NemotronHForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("dt_bias"):
                p.copy_(torch.linspace(-6.0, 1.0, p.numel()))
    return model.eval()


def test_packed_nemotron_h_forward_equals_the_padded_forward():
    """transformers' Nemotron-H (its torch Mamba path) run packed with ``seq_idx``: the padded forward's
    log-probs and entropy at every target, sequences of 9-11 tokens crossing chunks of 8 mid-way;
    without the restart (no ``seq_idx``: what transformers' torch path alone does) they differ."""
    from hpcrl.trainer.fsdp.segments import reset_at_sequence_starts, use_kernels

    reset_at_sequence_starts(use_kernels("auto", "cpu"))
    model = nemotron_h()
    b = batch([4, 9, 3, 6], [5, 2, 8, 4])
    with torch.no_grad():
        padded = token_logprobs(model, b)
        packed = packed_logprobs(model, b, recurrent=True)
        carried = packed_logprobs(model, b, recurrent=False)
    targets = b.loss_mask.bool()
    for got, want in zip(packed, padded, strict=True):
        assert torch.allclose(got[targets], want[targets], atol=1e-5)
    assert (carried[0][targets] - padded[0][targets]).abs().max() > 1e-2


def packed_equals_padded(model, b, monkeypatch):
    """The packed forward's log-probs and entropy at every target, and its gradients (of the weights
    the forward reaches: a VLM's tower gets none; to 1e-5 of each tensor's largest, at least 1e-5: Gemma's
    scaled embeddings give gradients of ~50), are the padded forward's, and no [L, L] mask is built on
    the way (transformers' SDPA mask function refuses while packed); returns the packed (log-probs,
    entropy, gradients)."""
    import transformers.masking_utils as masking

    from hpcrl.trainer.varlen import NAME

    targets = b.loss_mask.bool()

    def grads(forward):
        model.zero_grad()
        logp, entropy = forward(model, b)
        (logp * b.loss_mask).sum().backward()
        return (
            logp.detach(),
            entropy,
            {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        )

    padded = grads(token_logprobs)

    def no_mask(**kwargs):
        raise AssertionError("a packed forward built an attention mask")

    monkeypatch.setattr(masking, "sdpa_mask", no_mask)
    packed = grads(packed_logprobs)
    assert model.config.get_text_config()._attn_implementation == NAME
    for got, want in zip(packed[:2], padded[:2], strict=True):
        assert torch.allclose(got[targets], want[targets], atol=1e-5)
    assert packed[2].keys() == padded[2].keys()
    for name, want in padded[2].items():
        scale = max(1.0, want.abs().max().item())
        assert torch.allclose(packed[2][name], want, rtol=0, atol=1e-5 * scale), name
    return packed
