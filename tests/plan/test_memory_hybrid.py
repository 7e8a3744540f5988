"""The per-GPU estimate for Nemotron-H (Mamba-2 + attention + LatentMoE) against hand-computed numbers,
the Megatron layout limits the planner names, and the SSD scan's saved bytes measured."""

from __future__ import annotations

import pytest

from hpcrl.plan.activations import ssd_scan_bytes
from hpcrl.trainer.config import megatron_build_gap
from tests.conftest import SITE, compose, plan

GB = 1e9
NRL = "+experiment=dapo-nemotron-super-5n4g-megatron-tp4cp4ep4etp4"
# one TP x CP share of the NeMo RL layout: 8192 tokens / cp 4; tp = sp = expert_tp = 4
TOKENS = 2048
MAMBA = 4 * 4096 / 4 + 2 * (18560 + 2 * 10240) / 4 + 26 * 8192 / 4 + 4 * (256 + 640 + 384 + 128) * 128 / 4
MOE = 4 * 4096 / 4 + 22 * 2 * (4 * 1024 + 2 * 2688 / 4) + 2 * 4 * 512 / 4 + 2 * 1024 / 4 + 2 * 2 * 5376 / 4
ATTN = 4 * 4096 / 4 + 2 * (2 * 4096 / 4 + 2 * 2 * 128 / 2 * 4)  # K/V: 2 KV heads on 4 ranks, gathered over CP


def test_nemorl_layout_weights_and_optimizer_hand_computed():
    m = plan(NRL, *SITE).memory.train
    dense = 120_668_707_840 - 112_742_891_520
    replicated, qkv = 419_815_424, 150_994_944  # router + bias + latent projections + norms; Q/K/V
    dense_rank = (dense - replicated - qkv) / 4 + replicated + qkv / 2  # Q/K/V split over 2 KV heads only
    expert_rank = 112_742_891_520 / 16  # EP4 x ETP4
    assert m.weights == pytest.approx(2 * (dense_rank + expert_rank) / GB)
    assert m.grads == pytest.approx(4 * (dense_rank + expert_rank) / GB)
    assert m.optimizer == pytest.approx(12 * (dense_rank / 4 + expert_rank) / GB)  # dense over DP1 x CP4


def test_nemorl_layout_activations_hand_computed():
    m = plan(NRL, *SITE).memory.train
    inputs = 2 * 4096 * TOKENS * 88 / 4
    assert MAMBA > MOE > ATTN  # the Mamba layer is the one recomputed layer that counts
    assert m.activations == pytest.approx((inputs + TOKENS * MAMBA) / GB)
    full = plan(NRL, *SITE, "trainer.activation_checkpointing=false").memory.train
    assert full.activations == pytest.approx(TOKENS * (40 * MAMBA + 40 * MOE + 8 * ATTN) / GB)
    assert full.activations > 40  # 42 GB: why the recipe recomputes


def test_mamba_state_and_kv_split_over_the_engine():
    model = compose("model=nemotron_super").model
    kv = 8 * 2 * 2 * 128 * 2 * 8192  # 8 attention layers, 2 KV heads of 128, bf16
    mamba = 40 * (3 * 10240 * 2 + 128 * 64 * 128 * 4)  # conv state (kernel-1 x [x B C], bf16) + fp32 SSM
    assert model.kv_bytes_for_sequence(8192) == kv + mamba
    assert model.kv_bytes_for_sequence(8192, tp=4) == kv / 2 + mamba / 4  # KV heads replicated past 2
    r = plan(NRL, *SITE).memory.rollout
    assert r.kv_per_sequence == pytest.approx((kv / 2 + mamba / 4) / GB)


@pytest.mark.parametrize(
    "recipe",
    [
        "dapo-nemotron-super-5n4g-megatron",
        "dapo-nemotron-super-5n4g-megatron-tp4cp4ep4etp4",
        "dapo-nemotron-super-3n8g-megatron",
    ],
)
def test_super_recipes_fit_and_megatron_can_take_them(recipe):
    p = plan(f"+experiment={recipe}", *SITE)
    assert p.memory.fits, p.memory.problems
    assert p.memory.train_gpu_peak < p.memory.capacity
    assert p.backend_gaps == []


@pytest.mark.parametrize(
    ("tp", "pp", "cp", "message"),
    [
        (
            16,
            1,
            1,
            "trainer.tp=16 must divide nemotron_super's 8 Mamba groups (model.hybrid.mamba_groups): "
            "use trainer.tp in 1, 2, 4, 8",
        ),
        (4, 3, 1, "trainer.pp=3 must divide nemotron_super's 88 layers"),
        (8, 1, 32, "trainer.tp=8 x trainer.cp=32 must divide nemotron_super's 128 Mamba heads"),
        (4, 1, 4, ""),
        (8, 8, 1, ""),
    ],
)
def test_megatron_limits_for_nemotron_h(tp, pp, cp, message):
    gap = megatron_build_gap(compose("model=nemotron_super").model, tp, pp, cp)
    assert gap.startswith(message) if message else gap == ""


def test_ssd_scan_formula_matches_the_saved_tensors_of_a_torch_scan():
    """Autograd's saved tensors of transformers' pure-torch chunked scan, per head and token, against
    the estimate's term (which is hpcrl's own scan: one p-vector fewer, that scan folds D in outside)."""
    torch = pytest.importorskip("torch")
    scan = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h").mamba2_chunk_scan
    model = compose("model=nemotron_super").model
    length, heads, groups = 512, 4, 2
    hy = model.hybrid
    gen = torch.Generator().manual_seed(0)

    def leaf(*shape: int, dtype=torch.bfloat16):  # the mixer hands the scan bf16 activations
        return torch.randn(*shape, generator=gen).to(dtype).requires_grad_()

    x, dt = leaf(1, length, heads, hy.mamba_head_dim), leaf(1, length, heads)
    b, c = leaf(1, length, groups, hy.mamba_state), leaf(1, length, groups, hy.mamba_state)
    # A, D and dt_bias are trained parameters: autograd keeps what their gradients need too
    a, d, dt_bias = (leaf(heads, dtype=torch.float32) for _ in "adb")
    saved: dict[int, int] = {}
    inputs = {t.untyped_storage().data_ptr() for t in (x, dt, b, c)}

    def pack(t):
        if t.untyped_storage().data_ptr() not in inputs:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        scan(x, dt, a, b, c, hy.mamba_chunk, D=d, dt_bias=dt_bias, dt_softplus=True)
    per_head_token = sum(saved.values()) / (length * heads)
    expected = ssd_scan_bytes(model) / hy.mamba_heads + 4 * hy.mamba_head_dim
    assert per_head_token == pytest.approx(expected, rel=0.02)
