"""The FSDP2 trainer (gloo, CPU ranks): gradient accumulation, update direction, state round trip, the
metrics of two data-parallel ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hpcrl.core.files import crc32_of
from hpcrl.trainer.batch import build_batch
from hpcrl.trainer.fsdp import FSDPTrainer
from hpcrl.trainer.process_group import free_port
from tests.conftest import compose

pytestmark = pytest.mark.slow
MASTER = f"127.0.0.1:{free_port()}"


def batch():
    prompts = [[1, 5, 14, 6, 18], [1, 7, 15, 5, 18], [1, 9, 14, 9, 18], [1, 4, 14, 4, 18]]
    comps = [[7, 2], [6, 2], [5, 12, 2], [4, 2]]
    lps = [[-1.0] * len(c) for c in comps]
    return build_batch(prompts, comps, lps, advantages=[1.0, -1.0, 0.5, -0.5], keep=[1, 1, 1, 1], pad_id=0)


def trainer(tiny_dir, *overrides):
    cfg = compose("algo.lr=1e-3", "algo.kl_coef=0", *overrides)
    return FSDPTrainer(tiny_dir, cfg, master=MASTER)


def test_batch_masks_only_completion_tokens():
    b = batch()
    # sample 2: prompt of 5 tokens, completion of 3 -> targets 4, 5, 6
    assert b.loss_mask[2].tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert b.input_ids[2, 5:8].tolist() == [5, 12, 2]


def test_micro_batching_matches_one_big_batch(tiny_dir):
    big = trainer(tiny_dir, "trainer.micro_batch_size=4")
    small = trainer(tiny_dir, "trainer.micro_batch_size=1")
    m_big = big.train_step(batch())
    m_small = small.train_step(batch())
    # the step frees its gradients before it returns (the GPU is the engine's between steps)
    assert all(p.grad is None for t in (big, small) for p in t.model.parameters())
    assert m_small["loss"] == pytest.approx(m_big["loss"], abs=1e-6)
    assert m_small["grad_norm"] == pytest.approx(m_big["grad_norm"], rel=1e-5)
    wa, wb = big.export_weights(), small.export_weights()
    assert (
        max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-5
    )  # a wrong accumulation differs by ~lr (1e-3)


def test_packed_step_equals_the_padded_step(tiny_dir):
    """trainer.packing: micro-batches by a token budget, run as packed rows, give the padded step's
    loss, KL, gradient norm and weights (two minibatches and a reference policy: the log-prob passes
    run packed too, their bins out of row order)."""
    gen = torch.Generator().manual_seed(3)
    lengths = [(3, 9), (6, 2), (4, 12), (5, 1), (3, 5), (7, 7)]
    prompts = [torch.randint(3, 30, (p,), generator=gen).tolist() for p, _ in lengths]
    comps = [torch.randint(3, 30, (c,), generator=gen).tolist() for _, c in lengths]
    lps = [[-1.5] * len(c) for c in comps]
    b = build_batch(prompts, comps, lps, [1.0, -1.0, 0.5, -0.5, 0.25, -0.25], keep=[1] * 6, pad_id=0)
    common = ("algo.kl_coef=0.1", "algo.num_minibatches=2", "trainer.micro_batch_size=2")
    padded = trainer(tiny_dir, *common)
    packed = trainer(tiny_dir, *common, "trainer.packing=true", "trainer.micro_batch_tokens=20")
    assert [len(g) for g in packed.step.cut(b.attention_mask[:3].sum(1))] == [1, 2]  # 16 | 8 + 7
    m_padded, m_packed = padded.train_step(b), packed.train_step(b)
    for key in ("loss", "kl", "policy_loss", "entropy"):
        assert m_packed[key] == pytest.approx(m_padded[key], rel=1e-4, abs=1e-6), key
    assert m_packed["grad_norm"] == pytest.approx(m_padded["grad_norm"], rel=1e-4)
    wa, wb = padded.export_weights(), packed.export_weights()
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-5


def test_logprob_passes_take_their_own_batch_size(tiny_dir):
    """trainer.logprob_batch_size cuts the no-backward passes differently, with the same numbers."""
    one, four = (
        trainer(tiny_dir, "trainer.logprob_batch_size=1"),
        trainer(tiny_dir, "trainer.logprob_batch_size=4"),
    )
    assert one.cfg.trainer.logprob_rows() == 1 and four.cfg.trainer.logprob_rows() == 4
    assert len(one._logprob_groups(batch())) == 4 and len(four._logprob_groups(batch())) == 1
    assert torch.allclose(one.logprobs(batch()), four.logprobs(batch()), atol=1e-5)


def test_the_step_trains_at_the_rate_it_is_given(tiny_dir):
    """The schedule's rate reaches the optimizer: 0 leaves the weights, and Adam's first step moves
    each weight by about the rate (twice the rate, twice as far), whatever ``algo.lr`` says."""
    moved = []
    for lr in (0.0, 1e-4, 2e-4):
        t = trainer(tiny_dir)  # algo.lr=1e-3
        before = t.export_weights()
        t.train_step(batch(), lr)
        after = t.export_weights()
        moved.append(max((after[k] - before[k]).abs().max().item() for k in after))
    assert moved[0] == 0.0
    assert moved[2] == pytest.approx(2 * moved[1], rel=0.05) and moved[1] == pytest.approx(1e-4, rel=0.2)


@pytest.mark.parametrize(
    "variant",
    [
        [],
        # the loss variants through the same step; two minibatches, so the second trains against
        # the old policy's log-probs (ratios not 1)
        ["algo.policy_loss=gspo", "algo.loss_agg=sequence", "algo.num_minibatches=2"],
        ["algo.policy_loss=cispo", "algo.eps_low=1", "algo.num_minibatches=2"],
        ["algo=drgrpo"],
    ],
    ids=["ppo", "gspo", "cispo", "drgrpo"],
)
def test_update_follows_the_advantage_sign(tiny_dir, variant):
    t = trainer(tiny_dir, "algo.lr=3e-3", *variant)
    b = batch()
    before = (t.logprobs(b) * b.loss_mask).sum(1)
    for _ in range(3):
        metrics = t.train_step(b)
    after = (t.logprobs(b) * b.loss_mask).sum(1)
    change = (after - before).tolist()
    assert change[0] > 0 and change[2] > 0  # positive advantages: more likely
    assert change[1] < 0 and change[3] < 0  # negative advantages: less likely
    assert metrics["gen_kl_error"] > 0  # rollout logprobs were fake (-1.0): the metric sees the mismatch


def test_checkpoint_round_trip_and_tied_head(tiny_dir, tmp_path):
    a = trainer(tiny_dir)
    a.train_step(batch())
    a.save_checkpoint(str(tmp_path / "ckpt"), async_save=True)
    a.finish_checkpoint()
    # the rank's record of its shard, summed as it was written (the commit's manifest takes it)
    record = json.loads((tmp_path / "ckpt" / ".crc_0.json").read_text())
    shard = tmp_path / "ckpt" / "__0_0.distcp"
    assert record == {shard.name: {"size": shard.stat().st_size, "crc32": crc32_of(shard)}}
    b = trainer(tiny_dir)
    b.load_checkpoint(str(tmp_path / "ckpt"))
    wa, wb = a.export_weights(), b.export_weights()
    assert set(wa) == set(wb) and "lm_head.weight" in wa
    assert torch.equal(wa["lm_head.weight"], wa["model.embed_tokens.weight"])
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # the optimizer state came along: one more identical step keeps them identical
    a.train_step(batch())
    b.train_step(batch())
    wa, wb = a.export_weights(), b.export_weights()
    assert all(torch.allclose(wa[k], wb[k], atol=1e-7) for k in wa)


def test_fused_logprob_head_matches_the_logits_path(tiny_dir):
    """Same log-probs, loss and gradient norm with the chunked head as with full logits (and the
    padding mask left out for right-padded batches in both)."""
    fused = trainer(tiny_dir)
    plain = trainer(tiny_dir, "trainer.fused_logprob=false")
    b = batch()
    assert type(fused.model.lm_head).__name__ == "LogprobHead"
    assert type(plain.model.lm_head).__name__ == "Linear"
    torch.testing.assert_close(fused.logprobs(b), plain.logprobs(b), atol=1e-5, rtol=1e-5)
    m_fused, m_plain = fused.train_step(b), plain.train_step(b)
    for key in ("loss", "grad_norm", "entropy"):
        assert m_fused[key] == pytest.approx(m_plain[key], rel=1e-5, abs=1e-7), key
    wa, wb = fused.export_weights(), plain.export_weights()
    assert wa.keys() == wb.keys()
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-6


PACKED_UNEVEN = ("trainer.packing=true", "trainer.micro_batch_tokens=14")
"""Rank 0's rows (7 and 8 tokens) pack into two bins, rank 1's (7 and 7) into one: the ranks must still
run as many forwards (FSDP's gathers are collective), or the step hangs."""


def _dp_rank(rank: int, master: str, tiny_dir: str, out: str, extra: tuple[str, ...] = ()) -> None:
    """fsdp rank ``rank`` of two (gloo): the step on its shard, rows rank::2, as ``Fleet`` hands it."""
    cfg = compose("algo.lr=1e-3", "algo.kl_coef=0.05", *extra)
    t = FSDPTrainer(Path(tiny_dir), cfg, rank=rank, world=2, master=master)
    assert t.ref is not None and t.data_rank() == (rank, 2)
    torch.save(t.train_step(batch().select(slice(rank, None, 2))), Path(out) / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("extra", [(), PACKED_UNEVEN], ids=["padded", "packed-uneven-bins"])
def test_data_parallel_ranks_log_the_whole_batch(tiny_dir, tmp_path, extra):
    """Two fsdp ranks on their shards of a batch (5 and 4 loss tokens, rows of opposite advantage),
    each scoring its shard under its own reference model inside the step (algo.kl_coef > 0): both
    log the loss, KL, clip fraction, entropy and engine mismatch one rank logs for the whole batch,
    which rank 0's shard alone does not give. (The gradient norm differs: the ranks' gradients are
    averaged, each the mean over its own shard's tokens.)"""
    master = f"127.0.0.1:{free_port()}"
    torch.multiprocessing.spawn(_dp_rank, args=(master, str(tiny_dir), str(tmp_path), extra), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    whole = trainer(tiny_dir, "algo.kl_coef=0.05").train_step(batch())
    own = trainer(tiny_dir, "algo.kl_coef=0.05").train_step(batch().select(slice(0, None, 2)))
    for key in ("loss", "policy_loss", "kl", "clip_fraction", "entropy", "gen_kl_error"):
        assert ranks[0][key] == ranks[1][key] == pytest.approx(whole[key], rel=1e-5, abs=1e-7), key
    for key in ("loss", "gen_kl_error"):  # (a random tiny model's entropy is near log(vocab) on any rows)
        assert abs(own[key] - whole[key]) > 1e-3, key
