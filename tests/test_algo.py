"""GRPO/DAPO pieces against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from hpcrl.algo.advantages import group_advantages
from hpcrl.algo.config import AlgoConfig, Baseline, ISCorrection, KLType, LossAgg
from hpcrl.algo.losses import (
    PolicyLoss,
    aggregate,
    clipped_surrogate,
    gen_kl_error,
    importance_weights,
    kl_penalty,
)
from hpcrl.algo.shaping import informative_groups, overlong_penalty, scale_rewards, truncation_mask


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
        loss, clipped = clipped_surrogate(t([lg(ratio)]), t([0.0]), t(adv)[0], eps_low, eps_high, dual)
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
        loss = PolicyLoss.from_config(algo)
        assert (loss.eps_low, loss.eps_high, loss.dual_clip) == (0.2, 0.28, 3.0)
        assert (loss.kl_coef, loss.loss_agg, loss.is_correction) == (0.0, LossAgg.sequence, ISCorrection.none)


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
