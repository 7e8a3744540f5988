"""fsdp's context parallel (trainer/context_parallel.py) and activation checkpointing: the same step
as one rank, with the sequences really split and the layers really recomputed.

The layout helpers are checked by hand; the slow tests run tests/harness/megatron_parity.py under torchrun
(gloo, CPU, fp32) on a small Gemma 4 vision-language model, whose sliding layers (window 4) see less
than the parity batch's 8 positions, so a mask that ignored the window or the split would show.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hpcrl.config.compose import compose_config
from hpcrl.trainer.context_parallel import CPGroup, attend_chunks, rank_positions, sdpa, window_mask
from tests.harness.megatron_parity import parity_batch
from tests.harness.tiny_checkpoints import kinds_of, save_tiny
from tests.megatron.common import _assert_same_step, _torchrun, gemma3_model, gemma4_model


def test_each_rank_holds_an_early_and_a_late_chunk():
    """2 x cp chunks; rank r gets r and 2cp-1-r: at cp=2 over 8 positions, [0,1,6,7] and [2,3,4,5]."""
    assert rank_positions(0, 2, 2).tolist() == [0, 1, 6, 7]
    assert rank_positions(1, 2, 2).tolist() == [2, 3, 4, 5]
    assert rank_positions(2, 3, 1).tolist() == [2, 3]


def test_a_layout_pads_and_shards_by_true_positions():
    layout = CPGroup(2, 1, None).layout(7, "cpu")  # 7 positions pad to 8
    assert layout.width == 8 and layout.local.tolist() == [2, 3, 4, 5]
    assert layout.gathered.tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert layout.in_order.tolist() == [0, 1, 4, 5, 6, 7, 2, 3]
    ids = torch.arange(14).view(2, 7)
    assert layout.shard(ids, pad=-1).tolist() == [[2, 3, 4, 5], [9, 10, 11, 12]]
    assert layout.shard(ids, pad=-1)[:, 3].tolist() == [5, 12]


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("window", [None, 3, 100])
def test_each_ranks_chunks_attend_as_the_whole_sequence_does(cp, window):
    """``attend_chunks`` on every rank's queries = full causal (or sliding-window) attention at those
    positions: 4 query heads over 2 KV heads, 2 x cp chunks of 3 positions; a window of 100 reaches
    every key (the causal path)."""
    gen = torch.Generator().manual_seed(0)
    t = 2 * cp * 3
    q, k, v = (torch.randn(1, h, t, 8, generator=gen) for h in (4, 2, 2))
    allowed = window_mask(t, window or t, torch.device("cpu"))
    whole = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)

    for rank in range(cp):
        mine = rank_positions(rank, cp, 3)
        out = attend_chunks(q[:, :, mine], k, v, rank, cp, window, sdpa)
        assert torch.allclose(out, whole[:, :, mine], atol=1e-6), (rank, window)


@pytest.fixture(scope="module")
def gemma4_vlm_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("gemma4_vlm_cp")
    gemma4_model(vlm=True).save_pretrained(out)
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("cp", "recompute", "algo"),
    [
        (2, True, ()),
        (3, False, ("algo.policy_loss=gspo", "algo.loss_agg=sequence", "algo.num_minibatches=2")),
    ],
    ids=["cp2-recompute-grpo", "cp3-gspo-2-minibatches"],
)
def test_context_parallel_takes_the_one_rank_step(gemma4_vlm_dir, tmp_path, cp, recompute, algo):
    """CP equals one rank: log-probs (the reference pass), the step's metrics, gradients and updated
    weights. CP2 with activation checkpointing, GRPO; CP3 (the batch's 8 positions padded to 12, then
    cut back), GSPO's sequence-level ratio and the separate old-policy pass of two minibatches. The
    ranks ran their 8/cp share of the positions (4 each), and with recompute the first layer ran twice
    per training micro-batch: 7 rows are 4 micro-batches of 2 (two minibatches: 2 + 2), and the
    old-policy pass (no backward, no recompute) adds 4 more."""
    mask = parity_batch().loss_mask.bool()
    base = _torchrun(gemma4_vlm_dir, tmp_path / "one.pt", 1, 1, backend="fsdp", algo=algo)
    split = (f"trainer.cp={cp}", f"trainer.activation_checkpointing={str(recompute).lower()}", *algo)
    run = _torchrun(gemma4_vlm_dir, tmp_path / "cp.pt", 1, 1, port=29653, backend="fsdp", cp=cp, algo=split)
    _assert_same_step(run, base, mask, f"fsdp CP={cp}, recompute {recompute}")
    old_pass = 4 if algo else 0
    assert base["layout"] == {"cp": 1, "dp": 1, "widths": [8], "layer_calls": old_pass + 4}
    calls = old_pass + 4 * (2 if recompute else 1)
    assert run["layout"] == {"cp": cp, "dp": 1, "widths": [4], "layer_calls": calls}
    assert all(run["state_restored"]), run["state_restored"]


def _gemma3(out: Path) -> None:
    gemma3_model().save_pretrained(out)


def _gemma4_unified(out: Path) -> None:
    save_tiny(kinds_of(compose_config(["model=gemma4_12b"]).model), out)


@pytest.mark.slow
@pytest.mark.parametrize("make", [_gemma3, _gemma4_unified], ids=["gemma3", "gemma4-unified"])
def test_context_parallel_takes_the_one_rank_step_where_nemo_rl_keeps_cp1(tmp_path, make):
    """Gemma 3 (window 4; NeMo RL's DTensor CP fails on its window) and Gemma 4 12B's gemma4_unified
    checkpoint (no model-owned CP attention for NeMo RL): CP=2 takes the one-rank step."""
    make(tmp_path / "model")
    mask = parity_batch().loss_mask.bool()
    base = _torchrun(tmp_path / "model", tmp_path / "one.pt", 1, 1, backend="fsdp")
    run = _torchrun(
        tmp_path / "model",
        tmp_path / "cp2.pt",
        1,
        1,
        port=29654,
        backend="fsdp",
        cp=2,
        algo=("trainer.cp=2",),
    )
    _assert_same_step(run, base, mask, f"{make.__name__} fsdp CP=2")
    assert run["layout"]["widths"] == [4] and base["layout"]["widths"] == [8]


def test_rope_scaled_by_the_longest_position_is_named():
    from transformers import Gemma3TextConfig, Qwen2Config

    from hpcrl.trainer.fsdp import position_dependent_rope

    dynamic = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
    assert position_dependent_rope(Qwen2Config(rope_parameters=dynamic)) == "dynamic"
    assert position_dependent_rope(Qwen2Config()) == ""
    per_layer = {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4}, "full_attention": dynamic}
    assert position_dependent_rope(Gemma3TextConfig(rope_parameters=per_layer)) == "dynamic"
