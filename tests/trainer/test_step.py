"""The shared training step (trainer/step.py) over a fake backend that records what it is asked:
the order of the calls, the micro-batches it gets, and that token-share weighting makes the
accumulated gradient and metrics those of the whole minibatch. No model; a process group only where
two data-parallel ranks reduce their metrics."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from hpcrl.algo.config import LossAgg
from hpcrl.algo.losses import CISPOLoss, GSPOLoss, PolicyLoss, gen_kl_error
from hpcrl.trainer.batch import TrainBatch, build_batch
from hpcrl.trainer.step import WHOLE, LossFn, Metrics, StepBatch, Totals, TrainStep


def batch() -> TrainBatch:
    """Five sequences of uneven completion length (so micro-batches hold unequal token counts)."""
    prompts = [[1, 5, 6], [1, 7], [1, 9, 9, 4], [1, 4], [1, 8, 3]]
    comps = [[7, 2], [6, 5, 4, 2], [5], [4, 4, 4], [3, 2]]
    lps = [[-0.5 - 0.1 * j for j in range(len(c))] for c in comps]
    return build_batch(prompts, comps, lps, [1.0, -1.0, 0.5, -0.5, 2.0], [1, 1, 1, 1, 1], pad_id=0)


class FakeBackend:
    """Log-probs are a trainable table (one value per token): the 'model' is ``self.table``; the
    reference policy another, frozen (``self.reference``). Each row's first token is its row number
    in the whole batch (``numbered``), so a shard of it finds its own rows."""

    data_group: Any = None  # one data-parallel rank

    def __init__(self, b: TrainBatch) -> None:
        gen = torch.Generator().manual_seed(0)
        self.table = (-torch.rand(b.loss_mask.shape, generator=gen, dtype=torch.float64)).requires_grad_()
        gen = torch.Generator().manual_seed(2)
        self.reference = self.table.detach() - 0.5 * torch.rand(b.loss_mask.shape, generator=gen)
        self.events: list[str] = []
        self.grads: list[torch.Tensor] = []

    def logprobs(self, batch: TrainBatch, reference: bool = False) -> torch.Tensor:
        self.events.append("logprobs(reference)" if reference else "logprobs")
        return (self.reference if reference else self.table.detach())[batch.input_ids[:, 0]]

    def micro_batches(self, part: StepBatch, groups: list[torch.Tensor]) -> list[StepBatch]:
        self.events.append(f"micro_batches({len(part)}, {[len(g) for g in groups]})")
        return [part.select(g) for g in groups]

    def zero_grad(self) -> None:
        self.events.append("zero_grad")
        self.table.grad = None

    def forward_backward(self, micro_batches: list[StepBatch], loss_fn: LossFn) -> list[Metrics]:
        self.events.append(f"forward_backward({[len(mb) for mb in micro_batches]})")
        out = []
        for i, mb in enumerate(micro_batches):
            logp = self.table[mb.data.input_ids[:, 0]]
            loss, metrics = loss_fn(i, mb, logp, torch.ones_like(logp))
            loss.backward()
            out.append(metrics)
        return out

    def optimizer_step(self) -> float:
        self.events.append("optimizer_step")
        assert self.table.grad is not None
        self.grads.append(self.table.grad.clone())
        return 2.0


def numbered(b: TrainBatch) -> TrainBatch:
    """``b`` with each row's first token its row number (how the fake backend finds its table row)."""
    ids = b.input_ids.clone()
    ids[:, 0] = torch.arange(len(b))
    return TrainBatch(
        ids, b.attention_mask, b.loss_mask.double(), b.advantages.double(), b.rollout_logp.double()
    )


def test_calls_come_in_order_and_micro_batches_cut_each_minibatch():
    b = numbered(batch())
    backend = FakeBackend(b)
    metrics = TrainStep(PolicyLoss(), minibatches=2, micro_batch_size=2)(backend, b, "cpu")
    assert backend.events == [
        "logprobs",  # the old policy, scored once before the first update
        "zero_grad",
        "micro_batches(3, [2, 1])",
        "forward_backward([2, 1])",
        "optimizer_step",
        "zero_grad",
        "micro_batches(2, [2])",
        "forward_backward([2])",
        "optimizer_step",
        "zero_grad",  # the gradients go before the step returns: a colocated engine wakes next
    ]
    assert backend.table.grad is None
    assert metrics["grad_norm"] == 2.0 and metrics["entropy"] == pytest.approx(1.0)
    one = TrainStep(PolicyLoss(), minibatches=1, micro_batch_size=4)(FakeBackend(b), b, "cpu")
    assert set(one) == set(metrics)  # gen_kl_error too: from the forward's own log-probs
    assert metrics["time/ref_logprobs"] >= 0.0  # no reference pass (kl_coef 0): its time is ~0


def test_the_reference_scores_the_batch_first_and_only_with_a_kl_term():
    b = numbered(batch())
    backend = FakeBackend(b)
    TrainStep(PolicyLoss(kl_coef=0.1), minibatches=2, micro_batch_size=2)(backend, b, "cpu")
    assert backend.events[:3] == ["logprobs(reference)", "logprobs", "zero_grad"]
    without = FakeBackend(b)
    TrainStep(PolicyLoss(kl_coef=0.0), minibatches=1, micro_batch_size=2)(without, b, "cpu")
    assert "logprobs(reference)" not in without.events and "logprobs" not in without.events


@pytest.mark.parametrize("minibatches", [1, 2])
def test_without_engine_logprobs_there_is_no_gen_kl_error_and_the_step_is_the_same(minibatches):
    """rollout.logprobs=false: the batch's rollout log-probs are placeholders, so no mismatch is
    reported (it would be against zeros); the update itself never reads them without IS."""
    b = numbered(batch())
    with_lps = TrainStep(PolicyLoss(), minibatches, 2)(FakeBackend(b), b, "cpu")
    zeroed = TrainBatch(b.input_ids, b.attention_mask, b.loss_mask, b.advantages, b.rollout_logp * 0)
    without = TrainStep(PolicyLoss(), minibatches, 2, engine_logprobs=False)(
        FakeBackend(zeroed), zeroed, "cpu"
    )
    assert "gen_kl_error" in with_lps and "gen_kl_error" not in without
    same = set(without) - {"time/ref_logprobs"}  # the step's clock aside
    assert {k: without[k] for k in same} == {k: with_lps[k] for k in same}


@pytest.mark.parametrize("size", [1, 2, 5])
def test_token_shares_give_the_whole_minibatch_loss_and_gradient(size):
    """Micro-batches of any size accumulate to the minibatch's token-mean loss, its gradient and its
    metrics, against ``PolicyLoss`` called once on the whole batch (a reference with a KL term)."""
    b = numbered(batch())
    loss = PolicyLoss(kl_coef=0.1, loss_agg=LossAgg.token)
    backend = FakeBackend(b)
    metrics = TrainStep(loss, minibatches=1, micro_batch_size=size)(backend, b, "cpu")
    ref = backend.reference  # what the step scored the batch with

    table = backend.table.detach().clone().requires_grad_()
    whole = loss(table, table.detach(), ref, b.rollout_logp, b.advantages, b.loss_mask)
    whole.loss.backward()
    assert torch.allclose(backend.grads[0], table.grad, atol=1e-12)
    assert metrics["loss"] == pytest.approx(float(whole.loss.detach()), abs=1e-7)
    assert metrics["kl"] == pytest.approx(float(whole.kl), abs=1e-7)
    expected = gen_kl_error(table.detach(), b.rollout_logp, b.loss_mask)
    assert metrics["gen_kl_error"] == pytest.approx(float(expected), abs=1e-7)


class StaleBackend(FakeBackend):
    """The old policy differs from the current one (as after earlier optimizer steps), and
    ``micro_batches`` pads the last run with zero-mask rows, as megatron's pipeline does."""

    def logprobs(self, batch: TrainBatch, reference: bool = False) -> torch.Tensor:
        if reference:
            return super().logprobs(batch, reference)
        self.events.append("logprobs")
        gen = torch.Generator().manual_seed(1)
        shift = 0.3 * torch.randn(self.table.shape, generator=gen, dtype=torch.float64)
        return (self.table.detach() + shift)[batch.input_ids[:, 0]]

    def micro_batches(self, part: StepBatch, groups: list[torch.Tensor]) -> list[StepBatch]:
        runs = super().micro_batches(part, groups)
        extra = len(groups[0]) - len(runs[-1])
        if extra:
            pad = runs[-1].select(torch.zeros(extra, dtype=torch.long))
            pad.data.loss_mask.zero_()
            last = runs[-1]
            runs[-1] = StepBatch(
                TrainBatch(
                    *(torch.cat([a, b]) for a, b in zip(_fields(last.data), _fields(pad.data), strict=True))
                ),
                torch.cat([last.old_logp, pad.old_logp]) if last.old_logp is not None else None,
                torch.cat([last.ref_logp, pad.ref_logp]) if last.ref_logp is not None else None,
            )
        return runs


def _fields(b: TrainBatch) -> tuple[torch.Tensor, ...]:
    return (b.input_ids, b.attention_mask, b.loss_mask, b.advantages, b.rollout_logp)


@pytest.mark.parametrize("size", [1, 2, 3])
@pytest.mark.parametrize(
    "loss",
    [
        PolicyLoss(loss_agg=LossAgg.sequence),
        GSPOLoss(eps_low=0.1, eps_high=0.1, loss_agg=LossAgg.sequence),
        GSPOLoss(loss_agg=LossAgg.token),
        CISPOLoss(eps_low=1.0, eps_high=0.1),
        PolicyLoss(loss_agg=LossAgg.sequence_sum_norm, sum_norm=4.0),
    ],
    ids=["ppo-sequence", "gspo-sequence", "gspo-token", "cispo", "drgrpo"],
)
def test_every_variant_accumulates_to_each_minibatch(loss, size):
    """With a stale old policy, a filtered sample and padding rows in the last micro-batch, each
    minibatch's accumulated gradient and loss are those of ``loss`` called once on its rows: the
    step weighs micro-batches by the loss's own units (sequences for a sequence-level loss)."""
    b = numbered(batch())
    b.loss_mask[1] = 0  # a filtered sample: no loss tokens, not a sequence of the mean
    backend = StaleBackend(b)
    metrics = TrainStep(loss, minibatches=2, micro_batch_size=size)(backend, b, "cpu")
    old = backend.logprobs(b)
    assert (old - backend.table.detach()).abs().max() > 0.1  # the ratios are not all 1
    losses = []
    for k, rows in enumerate(torch.arange(len(b)).chunk(2)):
        table = backend.table.detach().clone().requires_grad_()
        part = b.select(rows)
        whole = loss(table[rows], old[rows], None, part.rollout_logp, part.advantages, part.loss_mask)
        whole.loss.backward()
        assert torch.allclose(backend.grads[k], table.grad, atol=1e-12), k
        losses.append(float(whole.loss.detach()))
    assert metrics["loss"] == pytest.approx(sum(losses) / 2, abs=1e-7)


@pytest.mark.parametrize(("minibatches", "size"), [(1, 1), (1, 2), (1, 5), (2, 2)])
def test_gen_kl_error_is_the_token_mean_over_the_completions_with_engine_logprobs(minibatches, size):
    """rollout.logprob_fraction: rows 1, 2 and 4 came without the engine's log-probs (NaN); the metric
    is the token mean over rows 0 and 3 alone, whichever micro-batches and minibatches hold them
    (a micro-batch with none of them adds nothing and dilutes nothing)."""
    b = numbered(batch())
    rlp = b.rollout_logp.clone()
    rlp[[1, 2, 4]] = float("nan")
    sampled = TrainBatch(b.input_ids, b.attention_mask, b.loss_mask, b.advantages, rlp)
    backend = FakeBackend(sampled)
    metrics = TrainStep(PolicyLoss(), minibatches, size)(backend, sampled, "cpu")
    first = FakeBackend(b).table.detach()  # the policy before the step: the old log-probs
    rows = [0, 3]
    want = gen_kl_error(first[rows], b.rollout_logp[rows], b.loss_mask[rows])
    assert float(want) > 0.01  # rows 0 and 3 do differ from the engine's numbers
    assert metrics["gen_kl_error"] == pytest.approx(float(want), abs=1e-7)
    assert all(math.isfinite(v) for v in metrics.values())


def test_a_sample_without_engine_logprobs_gets_nan_on_its_completion_only():
    """rollout.logprob_fraction: the engine hands back [] for a prompt it was not asked about."""
    prompts, comps = [[1, 5, 6], [1, 7]], [[7, 2], [6, 5, 4]]
    b = build_batch(prompts, comps, [[-0.5, -0.25], []], [1.0, -1.0], [1, 1], pad_id=0)
    assert b.rollout_logp[0].tolist() == [0.0, 0.0, -0.5, -0.25]  # targets 2, 3 predict the completion
    row = b.rollout_logp[1].tolist()
    assert row[0] == 0.0 and all(math.isnan(x) for x in row[1:4])
    with pytest.raises(ValueError, match="sample 1: 2 rollout logprobs for 3 completion tokens"):
        build_batch(prompts, comps, [[-0.5, -0.25], [-1.0, -1.0]], [1.0, -1.0], [1, 1], pad_id=0)


def test_old_policy_mismatch_is_the_whole_batch_mean_with_several_minibatches():
    b = numbered(batch())
    backend = FakeBackend(b)
    metrics = TrainStep(PolicyLoss(), minibatches=2, micro_batch_size=2)(backend, b, "cpu")
    old = backend.table.detach()
    assert metrics["gen_kl_error"] == pytest.approx(float(gen_kl_error(old, b.rollout_logp, b.loss_mask)))


def test_totals_sum_each_part_and_average_the_parts():
    """Tensors and floats add alike within a part (a minibatch); a metric is the mean over its parts,
    so one taken once over the whole batch (``WHOLE``) is not divided by the minibatches."""
    totals = Totals()
    for part, value in ((0, torch.tensor(1.5)), (0, torch.tensor(0.5)), (1, torch.tensor(4.0))):
        totals.add("loss", value, part)
    totals.add("grad_norm", 3.0, 0)
    totals.add("grad_norm", 1.0, 1)
    totals.add("gen_kl_error", torch.tensor(0.25), WHOLE)
    assert totals.means() == {"loss": 3.0, "grad_norm": 2.0, "gen_kl_error": 0.25}


def shards_batch() -> TrainBatch:
    """Eight sequences, numbered; the even rows (one shard of two) hold 7 loss tokens, the odd ones
    12: two of them came without the engine's log-probs and one is filtered out."""
    prompts = [[1, 5, 6], [1, 7], [1, 9, 9, 4], [1, 4], [1, 8, 3], [1, 2], [1, 6, 6], [1, 3, 5, 7]]
    comps = [[7, 2], [6, 5, 4, 2, 3], [5], [4, 4, 4], [3, 2, 2, 2], [9], [8, 8], [2, 4, 6]]
    lps = [[] if i in (2, 5) else [-0.5 - 0.1 * j for j in range(len(c))] for i, c in enumerate(comps)]
    adv = [1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 1.5, 0.25]
    return numbered(build_batch(prompts, comps, lps, adv, [1, 1, 1, 1, 1, 1, 0, 1], pad_id=0))


class SpreadBackend(StaleBackend):
    """Entropy that differs token by token (the fake's is 1 everywhere), so shards differ in it too."""

    def forward_backward(self, micro_batches: list[StepBatch], loss_fn: LossFn) -> list[Metrics]:
        out = []
        for i, mb in enumerate(micro_batches):
            logp = self.table[mb.data.input_ids[:, 0]]
            loss, metrics = loss_fn(i, mb, logp, -logp.detach())
            loss.backward()
            out.append(metrics)
        return out


CASES = {
    "token-1-minibatch": (PolicyLoss(kl_coef=0.1, loss_agg=LossAgg.token), 1, 2),
    "gspo-sequence-2-minibatches": (GSPOLoss(kl_coef=0.1, loss_agg=LossAgg.sequence), 2, 1),
}


def _train_shard(rank: int, port: int, case: str, out: str) -> None:
    """Data-parallel rank ``rank`` of two (gloo): the step on rows rank::2, as ``Fleet`` shards."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        loss, minibatches, size = CASES[case]
        b = shards_batch()
        backend = SpreadBackend(b)
        backend.data_group = dist.group.WORLD
        metrics = TrainStep(loss, minibatches, size)(backend, b.select(slice(rank, None, 2)), "cpu")
        torch.save(metrics, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_two_data_parallel_ranks_log_the_whole_batch(case, tmp_path):
    """Two gloo ranks, each stepping on its shard (their loss tokens 7 and 12, their losses, KL,
    entropy and engine mismatch all different): both log what one rank logs stepping on the whole
    batch. Rank 0's own numbers are not those."""
    from hpcrl.trainer.process_group import free_port

    torch.multiprocessing.spawn(_train_shard, args=(free_port(), case, str(tmp_path)), nprocs=2)
    loss, minibatches, size = CASES[case]
    b = shards_batch()
    whole = TrainStep(loss, minibatches, size)(SpreadBackend(b), b, "cpu")
    own = TrainStep(loss, minibatches, size)(SpreadBackend(b), b.select(slice(0, None, 2)), "cpu")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    keys = set(whole) - {"time/ref_logprobs"}
    assert {"loss", "policy_loss", "kl", "clip_fraction", "entropy", "gen_kl_error", "grad_norm"} <= keys
    for key in keys:
        assert ranks[0][key] == ranks[1][key] == pytest.approx(whole[key], rel=1e-12, abs=1e-12), key
    for key in ("loss", "policy_loss", "kl", "entropy", "gen_kl_error"):
        assert abs(own[key] - whole[key]) > 1e-3, key  # the shards do differ: rank 0's alone is not it
