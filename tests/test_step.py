"""The shared training step (trainer/step.py) over a fake backend that records what it is asked:
the order of the calls, the micro-batches it gets, and that token-share weighting makes the
accumulated gradient and metrics those of the whole minibatch. No model, no process group."""

from __future__ import annotations

import math

import pytest
import torch

from hpcrl.algo.config import LossAgg
from hpcrl.algo.losses import CISPOLoss, GSPOLoss, PolicyLoss, gen_kl_error
from hpcrl.trainer.batch import TrainBatch, build_batch
from hpcrl.trainer.step import LossFn, Metrics, StepBatch, Totals, TrainStep


def batch() -> TrainBatch:
    """Five sequences of uneven completion length (so micro-batches hold unequal token counts)."""
    prompts = [[1, 5, 6], [1, 7], [1, 9, 9, 4], [1, 4], [1, 8, 3]]
    comps = [[7, 2], [6, 5, 4, 2], [5], [4, 4, 4], [3, 2]]
    lps = [[-0.5 - 0.1 * j for j in range(len(c))] for c in comps]
    return build_batch(prompts, comps, lps, [1.0, -1.0, 0.5, -0.5, 2.0], [1, 1, 1, 1, 1], pad_id=0)


class FakeBackend:
    """Log-probs are a trainable table (one value per token): the 'model' is ``self.table``."""

    def __init__(self, b: TrainBatch) -> None:
        gen = torch.Generator().manual_seed(0)
        self.table = (-torch.rand(b.loss_mask.shape, generator=gen, dtype=torch.float64)).requires_grad_()
        self.events: list[str] = []
        self.grads: list[torch.Tensor] = []

    def logprobs(self, batch: TrainBatch, reference: bool = False) -> torch.Tensor:
        self.events.append("logprobs")
        return self.table.detach()[batch.input_ids[:, 0]]

    def micro_batches(self, part: StepBatch, size: int) -> list[StepBatch]:
        self.events.append(f"micro_batches({len(part)}, {size})")
        return [part.select(slice(i, i + size)) for i in range(0, len(part), size)]

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
    metrics = TrainStep(PolicyLoss(), minibatches=2, micro_batch_size=2)(backend, b, None, "cpu")
    assert backend.events == [
        "logprobs",  # the old policy, scored once before the first update
        "zero_grad",
        "micro_batches(3, 2)",
        "forward_backward([2, 1])",
        "optimizer_step",
        "zero_grad",
        "micro_batches(2, 2)",
        "forward_backward([2])",
        "optimizer_step",
        "zero_grad",  # the gradients go before the step returns: a colocated engine wakes next
    ]
    assert backend.table.grad is None
    assert metrics["grad_norm"] == 2.0 and metrics["entropy"] == pytest.approx(1.0)
    one = TrainStep(PolicyLoss(), minibatches=1, micro_batch_size=4)(FakeBackend(b), b, None, "cpu")
    assert set(one) == set(metrics)  # gen_kl_error too: from the forward's own log-probs


@pytest.mark.parametrize("minibatches", [1, 2])
def test_without_engine_logprobs_there_is_no_gen_kl_error_and_the_step_is_the_same(minibatches):
    """rollout.logprobs=false: the batch's rollout log-probs are placeholders, so no mismatch is
    reported (it would be against zeros); the update itself never reads them without IS."""
    b = numbered(batch())
    with_lps = TrainStep(PolicyLoss(), minibatches, 2)(FakeBackend(b), b, None, "cpu")
    zeroed = TrainBatch(b.input_ids, b.attention_mask, b.loss_mask, b.advantages, b.rollout_logp * 0)
    without = TrainStep(PolicyLoss(), minibatches, 2, engine_logprobs=False)(
        FakeBackend(zeroed), zeroed, None, "cpu"
    )
    assert "gen_kl_error" in with_lps and "gen_kl_error" not in without
    assert {k: without[k] for k in without} == {k: with_lps[k] for k in without}


@pytest.mark.parametrize("size", [1, 2, 5])
def test_token_shares_give_the_whole_minibatch_loss_and_gradient(size):
    """Micro-batches of any size accumulate to the minibatch's token-mean loss, its gradient and its
    metrics, against ``PolicyLoss`` called once on the whole batch (a reference with a KL term)."""
    b = numbered(batch())
    ref = (b.rollout_logp - 0.3) * b.loss_mask
    loss = PolicyLoss(kl_coef=0.1, loss_agg=LossAgg.token)
    backend = FakeBackend(b)
    metrics = TrainStep(loss, minibatches=1, micro_batch_size=size)(backend, b, ref, "cpu")

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
        self.events.append("logprobs")
        gen = torch.Generator().manual_seed(1)
        shift = 0.3 * torch.randn(self.table.shape, generator=gen, dtype=torch.float64)
        return (self.table.detach() + shift)[batch.input_ids[:, 0]]

    def micro_batches(self, part: StepBatch, size: int) -> list[StepBatch]:
        runs = super().micro_batches(part, size)
        extra = size - len(runs[-1])
        if extra:
            pad = runs[-1].select(torch.zeros(extra, dtype=torch.long))
            pad.data.loss_mask.zero_()
            last = runs[-1]
            runs[-1] = StepBatch(
                TrainBatch(
                    *(torch.cat([a, b]) for a, b in zip(_fields(last.data), _fields(pad.data), strict=True))
                ),
                torch.cat([last.old_logp, pad.old_logp]) if last.old_logp is not None else None,
                None,
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
    metrics = TrainStep(loss, minibatches=2, micro_batch_size=size)(backend, b, None, "cpu")
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
    metrics = TrainStep(PolicyLoss(), minibatches, size)(backend, sampled, None, "cpu")
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
    metrics = TrainStep(PolicyLoss(), minibatches=2, micro_batch_size=2)(backend, b, None, "cpu")
    old = backend.table.detach()
    assert metrics["gen_kl_error"] == pytest.approx(float(gen_kl_error(old, b.rollout_logp, b.loss_mask)))


def test_totals_sum_tensors_on_their_device_and_floats_as_floats():
    totals = Totals()
    for value in (torch.tensor(1.5), torch.tensor(2.5)):
        totals.add("loss", value)
    totals.add("grad_norm", 3.0)
    totals.add("grad_norm", 1.0)
    assert totals.means(2) == {"loss": 2.0, "grad_norm": 2.0}
