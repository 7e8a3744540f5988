"""The policy-gradient objective: ``PolicyLoss`` (GRPO/DAPO, built once from ``algo``) and its
pieces (clipped surrogate, KL to the reference, rollout importance-sampling correction, aggregation).

Every function takes per-token tensors of shape [batch, tokens] and a 0/1 ``mask`` of generated tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from hpcrl.algo.config import AlgoConfig, ISCorrection, KLType, LossAgg

MAX_LOG_RATIO = 20.0  # clamp |log ratio| before exp() so a large mismatch cannot overflow


def aggregate(values: torch.Tensor, mask: torch.Tensor, agg: LossAgg) -> torch.Tensor:
    """token: mean over every generated token of the batch; sequence: mean per sequence, then over sequences."""
    if agg is LossAgg.token:
        return (values * mask).sum() / mask.sum().clamp(min=1)
    per_seq = (values * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    return per_seq.mean()


def clipped_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
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
    ratio = torch.exp((logp - old_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    unclipped = -ratio * adv
    clipped = -ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    loss = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -dual_clip * adv), loss)
    return loss, (clipped > unclipped).float()


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

    tis: min(pi_train / pi_rollout, cap); icepop: the ratio itself, zeroed outside [1/cap, cap].
    """
    ratio = torch.exp((train_logp - rollout_logp).detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    if kind is ISCorrection.none:
        return torch.ones_like(ratio)
    if kind is ISCorrection.tis:
        return ratio.clamp(max=cap)
    keep = (ratio >= 1.0 / cap) & (ratio <= cap)
    return torch.where(keep, ratio, torch.zeros_like(ratio))


def gen_kl_error(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean k3 KL between trainer and rollout-engine logprobs over generated tokens (should be ~0).
    A 0-dim tensor, like every metric here: a GPU step converts its metrics to floats once, at
    its end, instead of waiting for the GPU at each one."""
    k3 = kl_penalty(train_logp.detach(), rollout_logp, KLType.k3)
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
    """The GRPO/DAPO objective over the generated tokens of a batch, built once from ``algo``:

        loss = agg(w * max(-r A, -clip(r, 1 - eps_low, 1 + eps_high) A)) + kl_coef * agg(KL(pi || pi_ref))

    r = pi / pi_old per token (pi_old: the policy that generated the rollouts, as the trainer scores
    it), A the sequence's advantage, w the rollout correction (``is_correction``: TIS or icepop on
    pi_old / pi_rollout), dual clip optional, agg per token or per sequence. GRPO and DAPO are
    settings of it (the ``algo`` groups): DAPO's clip-higher is ``eps_high``, its token-level mean
    ``loss_agg=token``.
    """

    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: float | None = None
    kl_coef: float = 0.0
    kl_type: KLType = KLType.k3
    loss_agg: LossAgg = LossAgg.token
    is_correction: ISCorrection = ISCorrection.none
    is_cap: float = 2.0

    @classmethod
    def from_config(cls, algo: AlgoConfig) -> PolicyLoss:
        """The settings of the same names in ``algo``."""
        return cls(**{f.name: getattr(algo, f.name) for f in fields(cls)})

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
        surrogate, clipped = clipped_surrogate(
            logp, old_logp, advantages, self.eps_low, self.eps_high, self.dual_clip
        )
        surrogate = surrogate * importance_weights(old_logp, rollout_logp, self.is_correction, self.is_cap)
        policy = aggregate(surrogate, mask, self.loss_agg)
        kl = (
            aggregate(kl_penalty(logp, ref_logp, self.kl_type), mask, self.loss_agg)
            if ref_logp is not None and self.kl_coef
            else None
        )
        total = policy + self.kl_coef * kl if kl is not None else policy
        return LossTerms(
            loss=total,
            policy=policy.detach(),
            kl=kl.detach() if kl is not None else torch.zeros((), device=total.device),
            clip_fraction=(clipped * mask).sum() / mask.sum().clamp(min=1),
        )
