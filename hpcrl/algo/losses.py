"""The policy-gradient objective: ``PolicyLoss`` (GRPO/DAPO) and its variants ``GSPOLoss`` and
``CISPOLoss``, one built from ``algo`` (``algo.policy_loss``), and their pieces (ratios, clipped
surrogate, KL to the reference, rollout importance-sampling correction, aggregation).

Every function takes per-token tensors of shape [batch, tokens] and a 0/1 ``mask`` of generated tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from hpcrl.algo.config import AlgoConfig, ISCorrection, KLType, LossAgg, PolicyLossType

MAX_LOG_RATIO = 20.0  # clamp |log ratio| before exp() so a large mismatch cannot overflow
MAX_KL = 10.0
"""Bound of the per-token KL estimate: k3 = e^x - 1 - x grows exponentially in x = log(ref/policy),
so a token where the reference is 15 nats above the policy gives 3.3e6 and would be the step's whole
KL term and gradient. veRL clamps the estimate to +-10 as well; beyond it the token adds no gradient.
The loss's KL term is bounded; ``gen_kl_error`` (a diagnostic) reports the estimate as it is."""


def aggregate(values: torch.Tensor, mask: torch.Tensor, agg: LossAgg, norm: float = 1.0) -> torch.Tensor:
    """token: mean over every generated token of the batch. sequence: mean over each sequence's
    tokens, then over the sequences that have any. sequence_sum_norm: each sequence's token sum /
    ``norm``, then that mean over sequences (Dr. GRPO: a token weighs the same in a long sequence as
    in a short one)."""
    if agg is LossAgg.token:
        return (values * mask).sum() / mask.sum().clamp(min=1)
    per_seq = (values * mask).sum(dim=1)
    per_seq = per_seq / (mask.sum(dim=1).clamp(min=1) if agg is LossAgg.sequence else norm)
    # rows without loss tokens (filtered samples, a backend's padding rows) are not sequences here
    return per_seq.sum() / aggregation_units(mask, agg).clamp(min=1)


def aggregation_units(mask: torch.Tensor, agg: LossAgg) -> torch.Tensor:
    """What ``aggregate`` averages over in ``mask``: its loss tokens (token) or its sequences with any
    (sequence, sequence_sum_norm). A micro-batch weighted by its share of its minibatch's units adds
    up to the minibatch's value (trainer/step.py)."""
    if agg is LossAgg.token:
        return mask.sum()
    return (mask.sum(dim=1) > 0).sum()


def token_ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """r_t = pi(y_t) / pi_old(y_t) per token."""
    return torch.exp((logp - old_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))


def sequence_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's s_i = exp(mean over sequence i's loss tokens of log r_t), the geometric mean of its
    tokens' ratios, at each of its tokens as sg(s_i) * pi(y_t) / sg(pi(y_t)): the value is s_i, the
    gradient through token t is s_i * grad log pi(y_t) (the paper's GSPO-token form)."""
    log_s = ((logp - old_logp).detach() * mask).sum(dim=1, keepdim=True)
    log_s = log_s / mask.sum(dim=1, keepdim=True).clamp(min=1)
    # log_s added last: logp - logp.detach() is exactly 0, so the value is log_s to the bit
    log_ratio = logp - logp.detach() + log_s
    return torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))


def clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO/GRPO loss -min(r A, clip(r, 1-eps_low, 1+eps_high) A), optionally dual-clipped.

    ``advantages`` is [batch] or [batch, tokens]. Returns (loss per token, 1.0 where clipping was active).
    Dual clip (Ye et al. 2020): for A < 0 the loss is capped at -c*A, so a huge ratio cannot dominate.
    """
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    unclipped = -ratio * adv
    clipped = -ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    loss = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -dual_clip * adv), loss)
    return loss, (clipped > unclipped).float()


def cispo_surrogate(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token CISPO loss -sg(w) A log pi with w = clip(r, 1-eps_low, 1+eps_high): the ratio only
    weighs the token's gradient, -w A grad log pi, so no token loses its gradient to the clip.

    Written with (log pi - sg(log pi) + 1) for log pi: the same gradient, and the value -w A, which
    reads like ppo's surrogate (log pi's own value would make the loss a weighted log-likelihood).
    Returns (loss per token, 1.0 where the weight was truncated).
    """
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    ratio = token_ratio(logp, old_logp).detach()
    weight = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    score = logp - logp.detach() + 1.0
    return -weight * adv * score, (weight != ratio).float()


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: KLType) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy (Schulman's k1/k2/k3)."""
    log_ratio = (ref_logp - logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)  # log(ref/policy)
    if kind is KLType.k1:
        return -log_ratio
    if kind is KLType.k2:
        return 0.5 * log_ratio**2
    return torch.exp(log_ratio) - 1.0 - log_ratio  # k3: unbiased, always >= 0


def importance_weights(
    train_logp: torch.Tensor, rollout_logp: torch.Tensor, kind: ISCorrection, cap: float
) -> torch.Tensor:
    """Correction for the rollout engine's logprobs differing from the trainer's (no gradient).

    tis: min(pi_train / pi_rollout, cap); icepop: the ratio itself, zeroed outside [1/cap, cap]. A
    token the engine sent no logprob for (NaN) weighs 1.
    """
    rollout_logp = torch.where(torch.isnan(rollout_logp), train_logp, rollout_logp)
    ratio = torch.exp((train_logp - rollout_logp).detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    if kind is ISCorrection.none:
        return torch.ones_like(ratio)
    if kind is ISCorrection.tis:
        return ratio.clamp(max=cap)
    keep = (ratio >= 1.0 / cap) & (ratio <= cap)
    return torch.where(keep, ratio, torch.zeros_like(ratio))


def gen_kl_error(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean k3 KL between trainer and rollout-engine logprobs over generated tokens (should be ~0);
    tokens whose engine logprob is NaN (the engine sent none) do not count. A 0-dim tensor, like every
    metric here: a GPU step converts its metrics to floats once, at its end, instead of waiting for
    the GPU at each one."""
    sent = ~torch.isnan(rollout_logp)
    k3 = kl_penalty(train_logp.detach(), torch.where(sent, rollout_logp, train_logp.detach()), KLType.k3)
    mask = mask * sent
    return (k3 * mask).sum() / mask.sum().clamp(min=1)


@dataclass(frozen=True)
class LossTerms:
    loss: torch.Tensor
    """The objective to differentiate."""
    policy: torch.Tensor
    """Detached 0-dim metrics from here on."""
    kl: torch.Tensor
    clip_fraction: torch.Tensor


@dataclass(frozen=True)
class PolicyLoss:
    """The GRPO/DAPO objective over the generated tokens of a batch (``algo.policy_loss=ppo``):

        loss = agg(w * max(-r A, -clip(r, 1 - eps_low, 1 + eps_high) A)) + kl_coef * agg(KL(pi || pi_ref))

    r = pi / pi_old per token (pi_old: the policy that generated the rollouts, as the trainer scores
    it), A the sequence's advantage, w the rollout correction (``is_correction``: TIS or icepop on
    pi_old / pi_rollout), dual clip optional, agg per token, per sequence or Dr. GRPO's constant-
    normalised sum. GRPO and DAPO are settings of it (the ``algo`` groups): DAPO's clip-higher is
    ``eps_high``, its token-level mean ``loss_agg=token``. The variants replace ``surrogate`` only.
    """

    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: float | None = None
    kl_coef: float = 0.0
    kl_type: KLType = KLType.k3
    loss_agg: LossAgg = LossAgg.token
    is_correction: ISCorrection = ISCorrection.none
    is_cap: float = 2.0
    sum_norm: float = 1.0
    """``loss_agg=sequence_sum_norm``'s constant: ``rollout.max_new_tokens`` (``from_config``)."""

    @classmethod
    def from_config(cls, algo: AlgoConfig, max_new_tokens: int) -> PolicyLoss:
        """The loss ``algo.policy_loss`` names, with the settings of the same names in ``algo``."""
        kind = LOSSES[algo.policy_loss]
        names = {f.name for f in fields(kind)} - {"sum_norm"}
        return kind(**{n: getattr(algo, n) for n in names}, sum_norm=float(max_new_tokens))

    def surrogate(
        self, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Loss per token and 1.0 where its clip was active: here the per-token clipped ratio."""
        ratio = token_ratio(logp, old_logp)
        return clipped_surrogate(ratio, advantages, self.eps_low, self.eps_high, self.dual_clip)

    def aggregate(self, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return aggregate(values, mask, self.loss_agg, self.sum_norm)

    def units(self, mask: torch.Tensor) -> torch.Tensor:
        """What ``aggregate`` averages over in ``mask`` (tokens or sequences): a micro-batch's weight."""
        return aggregation_units(mask, self.loss_agg)

    def __call__(
        self,
        logp: torch.Tensor,
        old_logp: torch.Tensor,
        ref_logp: torch.Tensor | None,
        rollout_logp: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
    ) -> LossTerms:
        """``logp`` carries the gradient; ``ref_logp`` None (or ``kl_coef`` 0) leaves the KL term out."""
        surrogate, clipped = self.surrogate(logp, old_logp, advantages, mask)
        surrogate = surrogate * importance_weights(old_logp, rollout_logp, self.is_correction, self.is_cap)
        policy = self.aggregate(surrogate, mask)
        kl = (
            self.aggregate(kl_penalty(logp, ref_logp, self.kl_type).clamp(-MAX_KL, MAX_KL), mask)
            if ref_logp is not None and self.kl_coef
            else None
        )
        total = policy + self.kl_coef * kl if kl is not None else policy
        # a mean over the same units as the loss (tokens, or sequences), so the step's shares add it up
        per = LossAgg.token if self.loss_agg is LossAgg.token else LossAgg.sequence
        return LossTerms(
            loss=total,
            policy=policy.detach(),
            kl=kl.detach() if kl is not None else torch.zeros((), device=total.device),
            clip_fraction=aggregate(clipped, mask, per),
        )


@dataclass(frozen=True)
class GSPOLoss(PolicyLoss):
    """GSPO (Zheng et al. 2025): ``PolicyLoss`` with one ratio per sequence, the geometric mean of its
    tokens' ratios, so a sequence is clipped (or not) as a whole. The variant MoE runs take: there a
    token's own ratio swings when its experts change between the old policy and the new."""

    def surrogate(
        self, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ratio = sequence_ratio(logp, old_logp, mask)
        return clipped_surrogate(ratio, advantages, self.eps_low, self.eps_high, self.dual_clip)


@dataclass(frozen=True)
class CISPOLoss(PolicyLoss):
    """CISPO (MiniMax-M1, 2025): ``PolicyLoss`` with the clipped ratio as a stop-gradient weight on
    each token's log-likelihood gradient (``cispo_surrogate``): clipping bounds a token's step
    instead of dropping it."""

    def __post_init__(self) -> None:
        if self.dual_clip is not None:
            raise ValueError("CISPO has no clipped surrogate for dual_clip to cap")

    def surrogate(
        self, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return cispo_surrogate(logp, old_logp, advantages, self.eps_low, self.eps_high)


LOSSES: dict[PolicyLossType, type[PolicyLoss]] = {
    PolicyLossType.ppo: PolicyLoss,
    PolicyLossType.gspo: GSPOLoss,
    PolicyLossType.cispo: CISPOLoss,
}
"""``algo.policy_loss`` -> its loss class."""
