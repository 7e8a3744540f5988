"""Algorithm schema shared by GRPO and DAPO: the two are config groups over the same pieces."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from hpcrl.core.checks import MISSING, in_range, non_negative, positive
from hpcrl.errors import ConfigError


class KLType(StrEnum):
    k1 = "k1"
    k2 = "k2"
    k3 = "k3"


class PolicyLossType(StrEnum):
    ppo = "ppo"  # per-token ratio, clipped (GRPO, DAPO)
    gspo = "gspo"  # one ratio per sequence, the geometric mean of its tokens' ratios, clipped (GSPO)
    cispo = "cispo"  # per-token ratio truncated as a stop-gradient weight on log pi; no token dropped (CISPO)


class LossAgg(StrEnum):
    token = "token"  # every generated token weighs the same (DAPO)
    sequence = "sequence"  # mean over each sequence's tokens, then over sequences (GRPO paper, GSPO)
    sequence_sum_norm = "sequence_sum_norm"  # each sequence's token sum / rollout.max_new_tokens (Dr. GRPO)


class Baseline(StrEnum):
    mean = "mean"  # group mean
    loo = "loo"  # leave-one-out mean of the other samples of the group


class LRSchedule(StrEnum):
    constant = "constant"
    linear = "linear"  # from algo.lr down to algo.lr_min at algo.max_steps
    cosine = "cosine"  # half a cosine from algo.lr to algo.lr_min at algo.max_steps


class ISCorrection(StrEnum):
    none = "none"
    tis = "tis"  # truncated importance sampling: weight min(ratio, cap)
    icepop = "icepop"  # drop tokens whose ratio leaves [1/cap, cap]


@dataclass
class AlgoConfig:
    """The defaults are GRPO's (``conf/algo/grpo.yaml`` only names it); DAPO changes a few of them."""

    name: str = MISSING
    """The algorithm as plans name it (grpo, dapo, gspo, drgrpo): set by the ``algo`` group option."""
    num_prompts_per_step: int = 32
    num_generations: int = 16
    """Samples per prompt: one GRPO group."""
    max_steps: int = 50
    lr: float = 1e-6
    lr_schedule: LRSchedule = LRSchedule.constant
    """The learning rate over the run's steps after the warmup (``algo/schedule.py``): constant, or a
    linear or cosine decay to ``lr_min`` at ``max_steps``. A pure function of the step: a resumed run
    continues where it stopped."""
    lr_warmup_steps: int = 0
    """Steps of linear warmup, from lr / lr_warmup_steps at step 1 to lr."""
    lr_min: float = 0.0
    """Where a decaying schedule ends."""
    kl_coef: float = 0.01
    kl_type: KLType = KLType.k3
    eps_low: float = 0.2
    eps_high: float = 0.2
    """Upper ratio clip; DAPO's clip-higher uses 0.28."""
    dual_clip: float | None = None
    """Dual-clip bound c (> 1) for negative advantages; None turns it off."""
    policy_loss: PolicyLossType = PolicyLossType.ppo
    """The surrogate (``hpcrl/algo/losses.py``), each with ``eps_low``/``eps_high`` as its clip range.
    ppo: r_t = pi/pi_old per token, loss max(-r A, -clip(r) A) (GRPO, DAPO).
    gspo: one ratio per sequence s = exp(mean over its tokens of log r_t), clipped like ppo's, the
    gradient reaching each token as s * grad log pi_t (GSPO, Zheng et al. 2025; veRL
    ``loss_mode=gspo``); its paper's clip range is 3e-4/4e-4 (``conf/algo/gspo.yaml``), with
    ``loss_agg=sequence``. cispo: loss -sg(clip(r_t)) A log pi_t: the ratio only weighs the token's
    gradient, so a clipped token still learns (MiniMax-M1; veRL ``loss_mode=cispo``, NeMo RL
    ``use_cispo``); ``eps_low=1`` leaves the weight without a lower bound, as MiniMax does. Not with
    ``dual_clip`` (there is no clipped surrogate to cap)."""
    loss_agg: LossAgg = LossAgg.token
    """How per-token losses (and the KL term) become one number. token: mean over every loss token of
    the minibatch. sequence: mean over each sequence's tokens, then over the sequences that have any.
    sequence_sum_norm: each sequence's token sum divided by ``rollout.max_new_tokens``, then the mean
    over sequences: every token weighs the same whatever its sequence's length (Dr. GRPO, Liu et al.
    2025; veRL ``seq-mean-token-sum-norm``; with ``std_normalize=false``, ``conf/algo/drgrpo.yaml``)."""
    baseline: Baseline = Baseline.mean
    std_normalize: bool = True
    """Divide each group's advantages by its reward std (GRPO); Dr. GRPO turns it off."""
    is_correction: ISCorrection = ISCorrection.none
    is_cap: float = 2.0
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and sample more prompts to refill the batch."""
    dynamic_sampling_max_rounds: int = 3
    overlong_buffer: int = 0
    """DAPO soft overlong punishment: tokens before max_new_tokens where the penalty ramps up (0 = off)."""
    overlong_penalty: float = 1.0
    overlong_filter: bool = False
    """Mask out truncated samples from the loss."""
    reward_scale_min: float | None = None
    reward_scale_max: float | None = None
    num_minibatches: int = 1
    """Optimizer steps per rollout batch."""
    val_period: int = 10
    val_at_start: bool = True
    max_staleness: int = 0
    """Policy versions a training sample may lag the trainer. 0: on-policy (generate, then train).
    N >= 1: the engines generate step s + N's batch while the trainers train step s, and take new
    weights between batches (1 = veRL's one-step-off); every sample is then exactly N versions old
    (``hpcrl/run/overlap.py``). Needs ``algo.is_correction`` against the engine's log-probs."""

    def check_schedule(self) -> None:
        non_negative("algo.lr_warmup_steps", self.lr_warmup_steps)
        non_negative("algo.lr_min", self.lr_min)
        if self.lr_warmup_steps >= self.max_steps:
            raise ConfigError(
                f"algo.lr_warmup_steps={self.lr_warmup_steps} leaves no step at the full rate of a "
                f"{self.max_steps}-step run (algo.max_steps): use fewer warmup steps"
            )
        if self.lr_min > self.lr:
            raise ConfigError(f"algo.lr_min={self.lr_min} is above algo.lr={self.lr}: the schedule decays")
        if self.lr_min and self.lr_schedule is LRSchedule.constant:
            raise ConfigError(
                f"algo.lr_min={self.lr_min} does nothing with algo.lr_schedule=constant: "
                "use lr_schedule=linear or cosine, or drop lr_min"
            )

    @property
    def samples_per_step(self) -> int:
        """Completions a step trains on: ``num_prompts_per_step`` x ``num_generations``."""
        return self.num_prompts_per_step * self.num_generations

    def check(self) -> None:
        for key in (
            "num_prompts_per_step",
            "num_generations",
            "max_steps",
            "lr",
            "is_cap",
            "dynamic_sampling_max_rounds",
            "num_minibatches",
            "val_period",
        ):
            positive(f"algo.{key}", getattr(self, key))
        non_negative("algo.kl_coef", self.kl_coef)
        self.check_schedule()
        non_negative("algo.max_staleness", self.max_staleness)
        in_range("algo.eps_low", self.eps_low, 0.0, 1.0)
        in_range("algo.eps_high", self.eps_high, 0.0, 10.0)
        non_negative("algo.overlong_buffer", self.overlong_buffer)
        non_negative("algo.overlong_penalty", self.overlong_penalty)
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ConfigError(f"algo.dual_clip={self.dual_clip} must be > 1 (or null to turn it off)")
        if self.dual_clip is not None and self.policy_loss is PolicyLossType.cispo:
            raise ConfigError(
                "algo.dual_clip does not apply to algo.policy_loss=cispo (its truncated weight has no "
                "clipped surrogate to cap): set algo.dual_clip=null"
            )
        if self.num_generations < 2:
            raise ConfigError(
                f"algo.num_generations={self.num_generations}: a group-relative baseline needs at least 2 samples"
            )
        lo, hi = self.reward_scale_min, self.reward_scale_max
        if (lo is None) != (hi is None) or (lo is not None and hi is not None and lo >= hi):
            raise ConfigError("algo.reward_scale_min/max must both be set with min < max (or both null)")
        samples = self.samples_per_step
        if samples % self.num_minibatches:
            raise ConfigError(
                f"algo.num_minibatches={self.num_minibatches} must divide the {samples} samples per step "
                "(num_prompts_per_step x num_generations)"
            )
