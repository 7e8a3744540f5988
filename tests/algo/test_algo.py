"""GRPO/DAPO pieces and the loss variants (GSPO, CISPO, Dr. GRPO) against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from hpcrl.algo.advantages import group_advantages
from hpcrl.algo.config import AlgoConfig, Baseline, ISCorrection, KLType, LossAgg, PolicyLossType
from hpcrl.algo.losses import (
    MAX_KL,
    CISPOLoss,
    GSPOLoss,
    PolicyLoss,
    aggregate,
    aggregation_units,
    cispo_surrogate,
    clipped_surrogate,
    gen_kl_error,
    importance_weights,
    kl_penalty,
    sequence_ratio,
    token_ratio,
)
from hpcrl.algo.shaping import informative_groups, overlong_penalty, scale_rewards, truncation_mask
from hpcrl.errors import ConfigError
from hpcrl.trainer.step import TrainStep
from tests.conftest import compose


def t(*rows):
    return torch.tensor(rows, dtype=torch.float64)


def lg(p):
    return math.log(p)


class TestAdvantages:
    def test_group_mean_without_std(self):
        adv = group_advantages(t([1, 0, 1, 0]), Baseline.mean, std_normalize=False)
        assert adv.tolist() == [[0.5, -0.5, 0.5, -0.5]]

    def test_group_mean_with_std(self):
        # unbiased std of [1,0,1,0] = sqrt(1/3); 0.5 / 0.57735 = 0.866025
        adv = group_advantages(t([1, 0, 1, 0]), Baseline.mean, std_normalize=True)
        assert adv[0].tolist() == pytest.approx([0.866025, -0.866025, 0.866025, -0.866025], abs=1e-5)

    def test_leave_one_out(self):
        # r_i minus the mean of the other two: 1-0, 0-0.5, 0-0.5
        adv = group_advantages(t([1, 0, 0]), Baseline.loo, std_normalize=False)
        assert adv[0].tolist() == pytest.approx([1.0, -0.5, -0.5])

    def test_equal_rewards_give_zero(self):
        adv = group_advantages(t([1, 1, 1], [0, 0, 0]), Baseline.mean, std_normalize=True)
        assert adv.abs().max().item() == 0.0

    def test_groups_are_independent(self):
        adv = group_advantages(t([1, 0], [3, 1]), Baseline.mean, std_normalize=False)
        assert adv.tolist() == [[0.5, -0.5], [1.0, -1.0]]

    def test_rejects_single_sample_groups(self):
        with pytest.raises(ValueError, match="n>=2"):
            group_advantages(t([1.0]))


class TestSurrogate:
    def case(self, ratio, adv, eps_low=0.2, eps_high=0.2, dual=None):
        r = token_ratio(t([lg(ratio)]), t([0.0]))
        loss, clipped = clipped_surrogate(r, t(adv)[0], eps_low, eps_high, dual)
        return loss.item(), clipped.item()

    def test_positive_advantage_clipped_above(self):
        assert self.case(1.5, [1.0]) == (pytest.approx(-1.2), 1.0)

    def test_negative_advantage_not_clipped_above(self):
        assert self.case(1.5, [-1.0]) == (pytest.approx(1.5), 0.0)

    def test_positive_advantage_below_range_is_not_clipped(self):
        assert self.case(0.5, [1.0]) == (pytest.approx(-0.5), 0.0)

    def test_clip_higher(self):
        assert self.case(1.25, [1.0], eps_high=0.28)[0] == pytest.approx(-1.25)
        assert self.case(1.25, [1.0], eps_high=0.2)[0] == pytest.approx(-1.2)

    def test_dual_clip_caps_negative_advantage(self):
        assert self.case(5.0, [-1.0], dual=3.0)[0] == pytest.approx(3.0)
        assert self.case(5.0, [-1.0])[0] == pytest.approx(5.0)


class TestKL:
    # policy p=0.5, reference q=0.25: log(q/p) = -log 2
    def test_k1(self):
        assert kl_penalty(t([lg(0.5)]), t([lg(0.25)]), KLType.k1).item() == pytest.approx(math.log(2))

    def test_k2(self):
        assert kl_penalty(t([lg(0.5)]), t([lg(0.25)]), KLType.k2).item() == pytest.approx(
            0.5 * math.log(2) ** 2
        )

    def test_k3(self):
        assert kl_penalty(t([lg(0.5)]), t([lg(0.25)]), KLType.k3).item() == pytest.approx(
            0.5 - 1 + math.log(2)
        )

    def test_k3_zero_when_equal(self):
        assert kl_penalty(t([lg(0.3)]), t([lg(0.3)]), KLType.k3).item() == 0.0


class TestAggregationAndIS:
    values = t([1, 2, 0], [3, 0, 0])
    mask = t([1, 1, 0], [1, 0, 0])

    def test_token_level(self):
        assert aggregate(self.values, self.mask, LossAgg.token).item() == pytest.approx(2.0)

    def test_sequence_level(self):
        assert aggregate(self.values, self.mask, LossAgg.sequence).item() == pytest.approx(2.25)

    def test_truncated_importance_sampling(self):
        w = importance_weights(t([lg(0.6), lg(0.3)]), t([lg(0.2), lg(0.2)]), ISCorrection.tis, cap=2.0)
        assert w[0].tolist() == pytest.approx([2.0, 1.5])

    def test_icepop_drops_outliers(self):
        w = importance_weights(t([lg(0.6), lg(0.3)]), t([lg(0.2), lg(0.2)]), ISCorrection.icepop, cap=2.0)
        assert w[0].tolist() == pytest.approx([0.0, 1.5])

    def test_gen_kl_error(self):
        err = gen_kl_error(t([lg(0.5), lg(0.9)]), t([lg(0.25), lg(0.9)]), t([1, 0]))
        assert float(err) == pytest.approx(0.5 - 1 + math.log(2))

    def test_gen_kl_error_leaves_out_tokens_the_engine_sent_no_logprob_for(self):
        # rollout.logprob_fraction: a NaN marks a completion without the engine's log-probs
        err = gen_kl_error(t([lg(0.5), lg(0.9), lg(0.3)]), t([lg(0.25), math.nan, math.nan]), t([1, 1, 1]))
        assert float(err) == pytest.approx(0.5 - 1 + math.log(2))
        assert float(gen_kl_error(t([lg(0.5)]), t([math.nan]), t([1]))) == 0.0

    def test_importance_weight_of_a_token_without_engine_logprob_is_one(self):
        w = importance_weights(t([lg(0.6), lg(0.3)]), t([lg(0.2), math.nan]), ISCorrection.tis, cap=2.0)
        assert w[0].tolist() == pytest.approx([2.0, 1.0])

    def test_full_loss_combines_terms(self):
        logp = t([lg(0.5)])
        loss = PolicyLoss(kl_coef=0.1, kl_type=KLType.k3, loss_agg=LossAgg.token)
        terms = loss(logp, logp, t([lg(0.25)]), logp, t(1.0)[0:1].reshape(1), t([1.0]))
        kl = 0.5 - 1 + math.log(2)
        assert float(terms.policy) == pytest.approx(-1.0)
        assert float(terms.kl) == pytest.approx(kl)
        assert terms.loss.item() == pytest.approx(-1.0 + 0.1 * kl)

    def test_loss_gradient_pushes_up_positive_advantage(self):
        logp = torch.tensor([[lg(0.5)]], dtype=torch.float64, requires_grad=True)
        loss = PolicyLoss(kl_coef=0.0)
        terms = loss(logp, logp.detach(), None, logp.detach(), t(1.0)[0:1].reshape(1), t([1.0]))
        terms.loss.backward()
        assert logp.grad is not None and logp.grad.item() == pytest.approx(-1.0)

    def test_rollout_correction_weights_the_surrogate(self):
        # old/rollout ratio 3 capped at 2 (TIS): the surrogate -r A = -1 is weighted by 2
        logp = t([lg(0.6)])
        loss = PolicyLoss(is_correction=ISCorrection.tis, is_cap=2.0)
        terms = loss(logp, logp, None, t([lg(0.2)]), t(1.0)[0:1].reshape(1), t([1.0]))
        assert float(terms.policy) == pytest.approx(-2.0)

    def test_built_from_the_algo_settings(self):
        algo = AlgoConfig(eps_high=0.28, dual_clip=3.0, kl_coef=0.0, loss_agg=LossAgg.sequence)
        loss = PolicyLoss.from_config(algo, max_new_tokens=64)
        assert type(loss) is PolicyLoss
        assert (loss.eps_low, loss.eps_high, loss.dual_clip) == (0.2, 0.28, 3.0)
        assert (loss.kl_coef, loss.loss_agg, loss.is_correction) == (0.0, LossAgg.sequence, ISCorrection.none)
        assert loss.sum_norm == 64.0


class TestShaping:
    def test_overlong_penalty_ramp(self):
        pen = overlong_penalty(torch.tensor([80, 90, 100, 120]), max_len=100, buffer=20, penalty=1.0)
        assert pen.tolist() == pytest.approx([0.0, -0.5, -1.0, -1.0])

    def test_overlong_penalty_off(self):
        assert overlong_penalty(torch.tensor([500]), 100, 0, 1.0).tolist() == [0.0]

    def test_truncation_mask(self):
        assert truncation_mask(torch.tensor([True, False])).tolist() == [0.0, 1.0]

    def test_scale_rewards(self):
        assert scale_rewards(t(-1, 0, 1, 2), -1.0, 1.0).tolist() == [0.0, 0.5, 1.0, 1.0]

    def test_dynamic_sampling_keeps_mixed_groups(self):
        assert informative_groups(t([1, 1], [0, 1], [0, 0])).tolist() == [False, True, False]


def leaf(*rows):
    """Log-probs that carry a gradient."""
    return torch.tensor(rows, dtype=torch.float64, requires_grad=True)


def loss_and_grad(loss, logp, old, adv, mask, rollout=None):
    terms = loss(logp, old, None, old if rollout is None else rollout, adv, mask)
    terms.loss.backward()
    return float(terms.loss.detach()), logp.grad.tolist(), terms


class TestAggregationUnits:
    values = t([1, 2, 0], [4, 0, 0], [9, 9, 9])
    mask = t([1, 1, 0], [1, 0, 0], [0, 0, 0])  # the last row has no loss token (filtered, or padding)

    def test_sequence_mean_skips_rows_without_tokens(self):
        # (1+2)/2 = 1.5 and 4/1 = 4 over the two sequences with tokens: 2.75
        assert aggregate(self.values, self.mask, LossAgg.sequence).item() == pytest.approx(2.75)

    def test_sequence_sum_norm(self):
        # token sums 3 and 4, each / 4 (the constant), mean over the two sequences: (0.75 + 1) / 2
        agg = aggregate(self.values, self.mask, LossAgg.sequence_sum_norm, norm=4.0)
        assert agg.item() == pytest.approx(0.875)

    def test_units(self):
        assert aggregation_units(self.mask, LossAgg.token).item() == 3
        assert aggregation_units(self.mask, LossAgg.sequence).item() == 2
        assert aggregation_units(self.mask, LossAgg.sequence_sum_norm).item() == 2


class TestGSPO:
    def test_sequence_ratio_is_the_geometric_mean_of_its_tokens(self):
        # row 0: token ratios 2 and 8 -> sqrt(16) = 4 at both tokens; the masked third token (ratio
        # 100) does not count. row 1: 0.5 and 2 -> 1.
        logp = t([lg(2), lg(8), lg(100)], [lg(0.5), lg(2), 0.0])
        ratio = sequence_ratio(logp, torch.zeros_like(logp), t([1, 1, 0], [1, 1, 0]))
        assert ratio[:, :2].tolist() == [pytest.approx([4.0, 4.0]), pytest.approx([1.0, 1.0])]

    def test_every_token_gets_the_sequence_ratio_as_gradient_weight(self):
        # ratios 1.1 and 0.9, old log-probs 0: s = sqrt(0.99) = 0.994987, inside [0.8, 1.2].
        # loss = mean_t(-s_t A) with s_t = sg(s) pi_t / sg(pi_t): d/dlogp_t = -s A / 2 = -0.497494
        # at both tokens (ppo would give -1.1/2 and -0.9/2: each token its own ratio).
        logp = leaf([lg(1.1), lg(0.9)])
        value, grad, _ = loss_and_grad(
            GSPOLoss(loss_agg=LossAgg.sequence), logp, t([0.0, 0.0]), t(1.0), t([1, 1])
        )
        assert value == pytest.approx(-0.994987, abs=1e-6)
        assert grad[0] == pytest.approx([-0.497494, -0.497494], abs=1e-6)

    def test_a_token_outside_the_range_does_not_clip_its_sequence(self):
        # ratios 2 and 0.5: s = 1, not clipped, so both tokens learn with weight 1: grad -1/2 each.
        # ppo clips the ratio-2 token (A > 0): grad 0 there, -0.5/2 = -0.25 at the other.
        logp, old, adv, mask = leaf([lg(2), lg(0.5)]), t([0.0, 0.0]), t(1.0), t([1, 1])
        _, gspo, terms = loss_and_grad(GSPOLoss(loss_agg=LossAgg.sequence), logp, old, adv, mask)
        assert gspo[0] == pytest.approx([-0.5, -0.5]) and float(terms.clip_fraction) == 0.0
        logp = leaf([lg(2), lg(0.5)])
        _, ppo, _ = loss_and_grad(PolicyLoss(loss_agg=LossAgg.sequence), logp, old, adv, mask)
        assert ppo[0] == pytest.approx([0.0, -0.25])

    @pytest.mark.parametrize(
        ("s", "adv", "value", "grad_per_token", "clipped"),
        [
            # A > 0: above 1 + eps_high = 1.2 the loss is -1.2 A, flat; just below it, -s A
            (1.21, 1.0, -1.2, 0.0, 1.0),
            (1.19, 1.0, -1.19, -1.19 / 2, 0.0),
            # A < 0: below 1 - eps_low = 0.8 the loss is -0.8 A = 0.8, flat; just above it, -s A
            (0.79, -1.0, 0.8, 0.0, 1.0),
            (0.81, -1.0, 0.81, 0.81 / 2, 0.0),
            # A < 0 above the range: not clipped (the pessimistic side), the gradient stays
            (1.5, -1.0, 1.5, 1.5 / 2, 0.0),
        ],
    )
    def test_clip_at_the_bounds(self, s, adv, value, grad_per_token, clipped):
        # two tokens with the same ratio s: the geometric mean is s
        logp = leaf([lg(s), lg(s)])
        loss = GSPOLoss(eps_low=0.2, eps_high=0.2, loss_agg=LossAgg.sequence)
        got, grad, terms = loss_and_grad(loss, logp, t([0.0, 0.0]), t(adv), t([1, 1]))
        assert got == pytest.approx(value)
        assert grad[0] == pytest.approx([grad_per_token] * 2)
        assert float(terms.clip_fraction) == clipped

    def test_clip_fraction_counts_sequences(self):
        # row 0 (s = 1.5, A > 0) clipped at all three tokens, row 1 (s = 1) not: half the sequences
        logp = t([lg(1.5), lg(1.5), lg(1.5)], [0.0, 0.0, 0.0])
        terms = GSPOLoss(loss_agg=LossAgg.sequence)(
            logp, torch.zeros_like(logp), None, logp, t(1.0, 1.0), t([1, 1, 1], [1, 0, 0])
        )
        assert float(terms.clip_fraction) == pytest.approx(0.5)


class TestCISPO:
    # token ratios 1.5, 1.0, 0.5 (old log-probs 0), A = 1, eps 0.2: weights 1.2, 1.0, 0.8
    logp = (lg(1.5), 0.0, lg(0.5))

    def test_weights_are_truncated_and_carry_no_gradient(self):
        # loss per token -w A: -1.2, -1, -0.8, token mean -1. d/dlogp_t = -w_t A / 3: the ratio-1
        # token gets -1/3 (a gradient through the ratio would double it), the ratio-1.5 token still
        # learns (ppo clips it to 0).
        logp = leaf(list(self.logp))
        value, grad, terms = loss_and_grad(CISPOLoss(), logp, t([0.0] * 3), t(1.0), t([1, 1, 1]))
        assert value == pytest.approx(-1.0)
        assert grad[0] == pytest.approx([-0.4, -1 / 3, -0.8 / 3])
        assert float(terms.clip_fraction) == pytest.approx(2 / 3)

    def test_negative_advantage_flips_the_step(self):
        logp = leaf(list(self.logp))
        _, grad, _ = loss_and_grad(CISPOLoss(), logp, t([0.0] * 3), t(-2.0), t([1, 1, 1]))
        assert grad[0] == pytest.approx([0.8, 2 / 3, 1.6 / 3])

    def test_eps_low_1_leaves_no_lower_bound(self):
        # MiniMax-M1's form: min(r, 1 + eps_high) only; the ratio-0.5 token keeps weight 0.5
        loss, clipped = cispo_surrogate(t(list(self.logp)), t([0.0] * 3), t(1.0), 1.0, 0.2)
        assert loss[0].tolist() == pytest.approx([-1.2, -1.0, -0.5])
        assert clipped[0].tolist() == [1.0, 0.0, 0.0]

    def test_masked_tokens_do_not_count(self):
        # only the first two tokens: (-1.2 - 1) / 2; the third gets no gradient
        logp = leaf(list(self.logp))
        value, grad, _ = loss_and_grad(CISPOLoss(), logp, t([0.0] * 3), t(1.0), t([1, 1, 0]))
        assert value == pytest.approx(-1.1)
        assert grad[0] == pytest.approx([-0.6, -0.5, 0.0])

    def test_refuses_dual_clip(self):
        with pytest.raises(ValueError, match="dual_clip"):
            CISPOLoss(dual_clip=3.0)


class TestDrGRPO:
    def test_every_token_weighs_the_same_whatever_its_length(self):
        # sequences of 1 and 3 tokens, on-policy (r = 1), A = 1. sequence_sum_norm with constant 4:
        # loss = (1/2)(-1/4 + -3/4) = -0.5; d/dlogp = -1/(2*4) = -0.125 at every token.
        # sequence (GRPO's mean per sequence): -1/2 at the lone token, -1/6 at each of the three.
        mask = t([1, 0, 0], [1, 1, 1])
        old = t([0.0, 0.0, 0.0], [0.0, 0.0, 0.0])
        logp = leaf([0.0, 0.0, 0.0], [0.0, 0.0, 0.0])
        drgrpo = PolicyLoss(loss_agg=LossAgg.sequence_sum_norm, sum_norm=4.0)
        value, grad, _ = loss_and_grad(drgrpo, logp, old, t(1.0, 1.0), mask)
        assert value == pytest.approx(-0.5)
        assert grad == [pytest.approx([-0.125, 0, 0]), pytest.approx([-0.125] * 3)]
        logp = leaf([0.0, 0.0, 0.0], [0.0, 0.0, 0.0])
        _, grad, _ = loss_and_grad(PolicyLoss(loss_agg=LossAgg.sequence), logp, old, t(1.0, 1.0), mask)
        assert grad == [pytest.approx([-0.5, 0, 0]), pytest.approx([-1 / 6] * 3)]

    def test_kl_is_normalised_the_same_way(self):
        # k1 KL = logp - ref = log 2 at each of 2 tokens: sum 2 log 2, / 4 = 0.5 log 2
        logp = t([lg(0.5), lg(0.5)])
        loss = PolicyLoss(kl_coef=1.0, kl_type=KLType.k1, loss_agg=LossAgg.sequence_sum_norm, sum_norm=4.0)
        terms = loss(logp, logp, t([lg(0.25), lg(0.25)]), logp, t(0.0)[0:1].reshape(1), t([1, 1]))
        assert float(terms.kl) == pytest.approx(0.5 * math.log(2))

    def test_one_extreme_token_cannot_be_the_whole_kl_term(self):
        """The reference 15 nats above the policy on one token: k3 is 3.3e6 there unbounded; the
        loss's term holds it at MAX_KL (no gradient beyond), while gen_kl_error reports it as it is."""
        logp = leaf([-16.0, -1.0])
        ref = t([-1.0, -1.0])
        loss = PolicyLoss(kl_coef=1.0, kl_type=KLType.k3, loss_agg=LossAgg.token)
        terms = loss(logp, logp.detach(), ref, logp.detach(), t(0.0)[0:1].reshape(1), t([1, 1]))
        assert float(terms.kl) == pytest.approx(MAX_KL / 2)  # (10 + 0) over 2 tokens
        terms.loss.backward()
        assert logp.grad is not None and logp.grad[0, 0] == 0.0
        raw = kl_penalty(logp.detach(), ref, KLType.k3)
        assert float(raw[0, 0]) > 3e6


class TestVariantsCompose:
    @pytest.mark.parametrize("kind", [PolicyLoss, GSPOLoss, CISPOLoss])
    @pytest.mark.parametrize(("correction", "weight"), [(ISCorrection.tis, 2.0), (ISCorrection.icepop, 0.0)])
    def test_rollout_correction_weights_each_variant(self, kind, correction, weight):
        # on-policy (r = 1, every variant's surrogate -A = -1), old/rollout ratio 0.6/0.2 = 3:
        # TIS caps the weight at 2 (loss -2, gradient -2), icepop drops the token (0 and 0)
        logp = leaf([lg(0.6)])
        loss = kind(is_correction=correction, is_cap=2.0)
        value, grad, _ = loss_and_grad(
            loss, logp, logp.detach(), t(1.0)[0:1].reshape(1), t([1.0]), t([lg(0.2)])
        )
        assert value == pytest.approx(-weight)
        assert grad[0] == pytest.approx([-weight])

    @pytest.mark.parametrize(
        ("policy_loss", "kind"),
        [
            (PolicyLossType.ppo, PolicyLoss),
            (PolicyLossType.gspo, GSPOLoss),
            (PolicyLossType.cispo, CISPOLoss),
        ],
    )
    def test_algo_key_picks_the_class(self, policy_loss, kind):
        loss = PolicyLoss.from_config(AlgoConfig(policy_loss=policy_loss, eps_low=0.1), max_new_tokens=8)
        assert type(loss) is kind and loss.eps_low == 0.1

    def test_variants_agree_on_policy_without_clipping(self):
        """At r = 1 nothing clips: all three give the same loss and the same gradient (the policy
        gradient -A grad log pi), for any aggregation."""
        mask = t([1, 1, 0], [1, 0, 0])
        grads = []
        for kind in (PolicyLoss, GSPOLoss, CISPOLoss):
            logp = leaf([-0.5, -1.0, 0.0], [-2.0, 0.0, 0.0])
            _, grad, _ = loss_and_grad(
                kind(loss_agg=LossAgg.sequence), logp, logp.detach(), t(1.0, -0.5), mask
            )
            grads.append(grad)
        # row 0: -1/2 per token; row 1: +0.5/1; then / 2 sequences
        assert grads[0] == grads[1] == grads[2] == [[-0.25, -0.25, 0.0], [0.25, 0.0, 0.0]]


class TestConfig:
    def test_gspo_preset(self):
        cfg = compose("algo=gspo", "rollout.max_new_tokens=96")
        loss = TrainStep.from_config(cfg).loss
        assert type(loss) is GSPOLoss and (loss.eps_low, loss.eps_high) == (0.0003, 0.0004)
        assert (loss.loss_agg, loss.kl_coef, cfg.algo.num_minibatches) == (LossAgg.sequence, 0.0, 4)

    def test_drgrpo_preset_normalises_by_max_new_tokens(self):
        cfg = compose("algo=drgrpo", "rollout.max_new_tokens=96")
        loss = TrainStep.from_config(cfg).loss
        assert type(loss) is PolicyLoss and cfg.algo.std_normalize is False
        assert (loss.loss_agg, loss.sum_norm, loss.kl_coef) == (LossAgg.sequence_sum_norm, 96.0, 0.0)

    def test_cispo_composes_with_dapo_settings(self):
        loss = TrainStep.from_config(compose("algo=dapo", "algo.policy_loss=cispo", "algo.eps_low=1")).loss
        assert type(loss) is CISPOLoss and (loss.eps_low, loss.eps_high) == (1.0, 0.28)

    @pytest.mark.parametrize(
        ("overrides", "message"),
        [
            (
                ["algo.policy_loss=cispo", "algo.dual_clip=3"],
                r"^algo.dual_clip does not apply to algo.policy_loss=cispo",
            ),
            (["algo.policy_loss=gpso"], r"expected one of \[ppo, gspo, cispo\]"),
            (
                ["algo.loss_agg=seq-mean-token-sum-norm"],
                r"expected one of \[token, sequence, sequence_sum_norm\]",
            ),
        ],
    )
    def test_refusals_are_one_line(self, overrides, message):
        with pytest.raises(ConfigError, match=message) as info:
            compose(*overrides)
        assert "\n" not in str(info.value)
