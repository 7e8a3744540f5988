"""Memory estimate against hand-computed numbers, and the seed's fit / no-fit claims."""

from __future__ import annotations

import pytest

from hpcrl.plan.topology import Placement

from .conftest import ROOT, SITE, plan

GB = 1e9


def test_qwen2_1p5b_megatron_tp2_hand_computed():
    p = plan(
        "model=qwen2_1p5b",
        "trainer=megatron",
        "trainer.tp=2",
        "cluster=h100",
        *SITE,
        "data=openmathinstruct2",
    )
    m = p.memory.train
    params = 1_543_569_408
    shard = params / 2  # tp=2, pp=1
    assert m.weights == pytest.approx(2 * shard / GB)
    assert m.grads == pytest.approx(4 * shard / GB)
    assert m.optimizer == pytest.approx(12 * shard / 4 / GB)  # distributed over dp=4
    tokens, h, layers = 2048, 1536, 28
    recompute = 2 * h * tokens * layers / 2 + 34 * h * tokens / 2
    assert m.activations == pytest.approx(recompute / GB)
    assert m.logits == pytest.approx(tokens * 151936 / 2 * 8 / GB)


def test_tp_without_sequence_parallel_keeps_norm_activations_whole():
    base = (
        "model=qwen2_1p5b",
        "trainer=megatron",
        "trainer.tp=2",
        "cluster=h100",
        *SITE,
        "data=openmathinstruct2",
        "trainer.activation_checkpointing=false",
    )
    tokens, h, layers = 2048, 1536, 28
    with_sp = plan(*base).memory.train.activations
    without = plan(*base, "trainer.sequence_parallel=false").memory.train.activations
    assert with_sp == pytest.approx(34 * h * tokens / 2 * layers / GB)
    assert without == pytest.approx((10 + 24 / 2) * h * tokens * layers / GB)


def test_llama_8b_fsdp_hand_computed():
    p = plan("model=llama3p1_8b", "trainer=fsdp", "cluster=h100", *SITE)
    m = p.memory.train
    params = 8_029_995_008
    shard = params / 8
    layer = (params - 2 * 128256 * 4096) / 32
    assert m.weights == pytest.approx((4 * shard + 4 * layer) / GB)
    assert m.grads == pytest.approx(4 * shard / GB)
    assert m.optimizer == pytest.approx(8 * shard / GB)
    # the chunked log-prob head: one chunk of bf16 logits + its gradient (at most 2^30 elements; here
    # the micro-batch, 4 x (64 prompt + 1024 new) tokens, is smaller than a chunk)
    assert m.logits == pytest.approx(4 * (64 + 1024) * 128256 * 2 * 2 / GB)
    plain = plan("model=llama3p1_8b", "trainer=fsdp", "cluster=h100", "trainer.fused_logprob=false", *SITE)
    assert plain.memory.train.logits == pytest.approx(2 * m.logits)  # fp32 logits + gradient, all tokens


def test_recompute_shrinks_activations():
    base = ("model=qwen3_8b", "cluster=h100", *SITE)
    without = plan(*base, "trainer.activation_checkpointing=false").memory.train.activations
    with_ = plan(*base, "trainer.activation_checkpointing=true").memory.train.activations
    assert with_ < without / 5


@pytest.mark.parametrize("recipe", ["dapo-nemotron-super-5n4g-megatron", "dapo-nemotron-super-3n8g-megatron"])
def test_nemotron_super_split_fits(recipe):
    p = plan(f"+experiment={recipe}", *SITE)
    assert p.topology.placement is Placement.SPLIT
    assert p.memory.fits, p.memory.problems


@pytest.mark.parametrize(
    ("recipe", "nodes", "ep"),
    # all nodes colocated; EP must divide both the GPU count (20 / 24) and the 512 experts
    [("dapo-nemotron-super-5n4g-megatron", 5, 4), ("dapo-nemotron-super-3n8g-megatron", 3, 8)],
)
def test_nemotron_super_colocated_does_not_fit(recipe, nodes, ep):
    p = plan(
        f"+experiment={recipe}",
        *SITE,
        "layout.rollout_nodes=0",
        f"layout.train_nodes={nodes}",
        f"trainer.ep={ep}",
    )
    assert p.topology.placement is Placement.COLOCATED
    assert not p.memory.fits
    assert any("colocated rollout needs the training state" in x for x in p.memory.problems)


def test_gemma3_1b_colocated_fits_with_room():
    p = plan("+experiment=grpo-gemma3-1b-it-1n8g-fsdp2tp1", *SITE)
    assert p.memory.fits and p.memory.train_gpu_peak < 0.8 * p.memory.capacity


def test_kv_capacity_counts_sequences():
    p = plan("+experiment=dapo-nemotron-super-5n4g-megatron", *SITE)
    r = p.memory.rollout
    assert r.weights == pytest.approx(2 * p.cfg.model.param_counts().total / 4 / GB)
    assert r.sequences_that_fit == int((r.budget - r.weights - 2.0) // r.kv_per_sequence)


def test_the_reference_policy_is_counted_as_the_trainer_holds_it():
    """fsdp: fp32, sharded over the training world like the policy; megatron: fp32, split by TP/PP
    only (a copy per data-parallel rank); nothing without a KL term."""
    base = ("model=qwen2_1p5b", "cluster=h100", *SITE, "data=openmathinstruct2")
    params = 1_543_569_408
    fsdp, none = plan(*base, "algo.kl_coef=0.01"), plan(*base, "algo.kl_coef=0")
    assert fsdp.memory.train.reference == pytest.approx(4 * params / fsdp.topology.train.world / GB)
    assert none.memory.train.reference == 0
    assert fsdp.memory.train.peak - none.memory.train.peak == pytest.approx(fsdp.memory.train.reference)
    mega = plan(*base, "trainer=megatron", "trainer.tp=2", "algo.kl_coef=0.01")
    assert mega.memory.train.reference == pytest.approx(4 * params / 2 / GB)


def test_start_up_holds_the_shards_and_one_layer_not_the_gradients():
    m = plan("model=qwen2_1p5b", "cluster=h100", *SITE, "data=openmathinstruct2", "algo.kl_coef=0.01").memory
    t = m.train
    assert t.startup == pytest.approx(t.weights - t.gathered + t.reference + t.loading + t.overhead)
    assert 0 < t.loading < t.weights and t.startup < t.resident


RECIPES = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_shipped_recipe_starts_and_trains_within_its_gpus(recipe):
    p = plan(f"+experiment={recipe}", *SITE)
    m, t = p.memory, p.memory.train
    numbers = (
        f"{recipe}: start-up {t.startup:.1f} GB, training peak {m.train_gpu_peak:.1f} GB (reference "
        f"{t.reference:.1f} GB) per GPU of {m.capacity:.0f} GB"
    )
    assert t.startup <= m.capacity and m.train_gpu_peak <= m.capacity, numbers
    assert (t.reference > 0) == (p.cfg.algo.kl_coef > 0), numbers
