"""The algorithms' settings and the names of their choices: plain dataclasses, no torch.

The tensor functions that use them live beside them (``grpo``, ``ppo``,
``policy_loss``, ``kl``, ``corrections``, ``estimators``); the settings are
here so that reading a config -- the command line, the driver, an actor's
start -- does not import torch. Each choice is a ``Literal``: argparse
offers its values and ``vime.settings.check_choices`` refuses others.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal

from vime.settings import check_choices, setting

AdvantageEstimator = Literal["grpo", "gspo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"]
# the estimators whose advantages are built from per-token rewards, into which --kl-coef folds its penalty
REWARD_KL_ESTIMATORS: tuple[AdvantageEstimator, ...] = ("ppo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
# baselines from the prompt's own group: a group of one response gets advantage 0, so nothing is learned
GROUP_BASELINES: tuple[AdvantageEstimator, ...] = ("grpo", "gspo", "rloo", "reinforce_plus_plus_baseline")
PolicyLoss = Literal["ppo", "cispo"]
RatioLevel = Literal["token", "sequence"]
LossAggregation = Literal["token", "sequence", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
KlEstimator = Literal["k1", "k2", "k3", "low_var_kl"]
OffPolicyCorrection = Literal["none", "tis", "icepop", "decoupled"]
TisLevel = Literal["token", "sequence-geometric", "sequence-product"]
StaleRatio = Literal["behaviour", "proximal"]


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    normalize_std: bool = setting(True, "False: Dr.GRPO (centre only)")
    std_eps: float = setting(1e-6, "added to the group's reward std before dividing")


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    gamma: float = setting(1.0, "discount per token (PPO's GAE, REINFORCE++'s returns)")
    lam: float = setting(0.95, "GAE lambda", flags=("--lam", "--lambd"))
    value_clip: float = setting(0.2, "value loss clipped to this around the step's starting values")
    value_coef: float = setting(0.5, "weight of the value loss")
    whiten_advantages: bool = setting(True, "normalise advantages over the batch (mean 0, std 1)")


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    """Settings of the loss, common to every estimator, and the two KL coefficients."""

    policy_loss: PolicyLoss = setting("ppo", "ppo: the clipped surrogate; cispo: MiniMax-M1's clipped, detached "
                                             "importance weight times log pi (every token keeps a gradient)")
    clip_low: float = setting(0.2, "ratio floor is 1 - clip_low (cispo: the importance weight's); given as "
                                   "--eps-clip without a ceiling, the ceiling too, as in slime",
                              flags=("--clip-low", "--eps-clip"))
    clip_high: float = setting(0.2, "ratio ceiling is 1 + clip_high (DAPO uses 0.28; cispo: the importance "
                                    "weight's)", flags=("--clip-high", "--eps-clip-high"))
    dual_clip_c: float = setting(0.0, "dual-clip PPO: a token with a negative advantage loses at most -c * A "
                                      "(slime's eps_clip_c, verl's clip_ratio_c, often 3); 0: off, else > 1",
                                 flags=("--dual-clip-c", "--eps-clip-c"))
    ratio_level: RatioLevel = setting("token", "'token': PPO/GRPO ratios per token; 'sequence': GSPO, one ratio per "
                                        "response (with --loss-aggregation token a length-weighted GSPO, not the "
                                        "paper's per-sequence objective)")
    loss_aggregation: LossAggregation = setting("token", "token: mean over all tokens of the batch; sequence: per "
                                                         "response first; seq-mean-token-sum: each response's token "
                                                         "sum, averaged; seq-mean-token-sum-norm: token sums over "
                                                         "responses x --loss-scale-tokens (Dr.GRPO)")
    loss_scale_tokens: int = setting(0, "seq-mean-token-sum-norm's constant per response; 0: the longest response "
                                        "the run generates (--max-new-tokens, or --max-response-tokens with "
                                        "--tool or --openai-endpoint)")
    kl_loss_coef: float = setting(0.0, "> 0: a KL term to a frozen reference model in the loss (vime's --kl-coef "
                                       "before issue 31; slime's --kl-loss-coef)")
    kl_coef: float = setting(0.0, "> 0: a KL penalty folded into each token's reward (slime's --kl-coef, verl's "
                                  "kl_ctrl; ppo, reinforce_plus_plus and reinforce_plus_plus_baseline). Not the loss "
                                  "term: that is --kl-loss-coef, which was vime's --kl-coef before issue 31")
    kl_estimator: KlEstimator = setting("k3", "k1: log p - log p_ref; k2: half its square; k3: Schulman's unbiased, "
                                              "always >= 0; low_var_kl: k3 clamped to [-10, 10] (verl, slime). For "
                                              "both KL terms. slime's --kl-loss-type, whose default with "
                                              "--use-kl-loss is k1",
                                        flags=("--kl-estimator", "--kl-loss-type"))
    entropy_coef: float = setting(0.0, "> 0 rewards entropy (a bonus, subtracted from the loss)")
    off_policy_correction: OffPolicyCorrection = setting("none", "weigh tokens by pi_old / pi_behaviour: tis "
                                                                 "truncates the weight to [--tis-floor, --tis-cap]; "
                                                                 "icepop drops tokens outside it; decoupled (AReaL) "
                                                                 "drops tokens above --tis-cap")
    tis_cap: float = setting(2.0, "the importance weight's upper bound (tis truncates, icepop and decoupled drop)",
                             flags=("--tis-cap", "--tis-clip"))
    tis_floor: float = setting(0.0, "the importance weight's lower bound (tis raises to it, icepop drops below it; "
                                    "IcePop uses 0.5 with a cap of 5)", flags=("--tis-floor", "--tis-clip-low"))
    tis_level: TisLevel = setting("token", "whose importance weight: token; sequence-geometric (the geometric mean of "
                                      "the response's token weights); sequence-product (their product); slime's "
                                      "geometric and sequence are the two sequence levels",
                                  spellings={"geometric": "sequence-geometric", "sequence": "sequence-product"})
    stale_ratio: StaleRatio = setting("behaviour", "the PPO ratio of a token sampled by older weights than the "
                                                   "trainer's (--max-staleness > 0): behaviour: against the "
                                                   "log-probs it was sampled with, so the clip bounds the policy's "
                                                   "movement from the policy that sampled it; proximal: against "
                                                   "the trainer's recomputed ones, as fresh tokens (vime before "
                                                   "issue 30: nothing bounds that movement). With "
                                                   "--off-policy-correction the correction treats stale tokens and "
                                                   "this is not used")

    def __post_init__(self) -> None:
        check_choices(self)
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ValueError("clip_low must be in [0, 1) and clip_high >= 0")
        if self.dual_clip_c and not self.dual_clip_c > 1:
            raise ValueError(f"--dual-clip-c must be > 1 (or 0: off), not {self.dual_clip_c}")
        if self.dual_clip_c and self.policy_loss == "cispo":
            raise ValueError("--dual-clip-c applies to --policy-loss ppo; cispo bounds its weight with the clips")
        if self.policy_loss == "cispo" and self.ratio_level != "token":
            raise ValueError("--policy-loss cispo weighs each token by its own ratio: use it with --ratio-level token "
                             "(and not --advantage-estimator gspo)")
        if not self.tis_cap >= 1.0:
            raise ValueError(f"tis_cap must be >= 1 (a weight of 1 means on-policy), not {self.tis_cap}")
        if not 0.0 <= self.tis_floor <= 1.0:
            raise ValueError(f"--tis-floor must be in [0, 1] (a weight of 1 means on-policy), not {self.tis_floor}")
        if self.off_policy_correction == "decoupled" and (self.tis_level != "token" or self.tis_floor):
            raise ValueError("--off-policy-correction decoupled is token-level with an upper bound only: leave "
                             "--tis-level token and --tis-floor 0, or use tis or icepop")
        if self.kl_coef < 0 or self.kl_loss_coef < 0 or self.loss_scale_tokens < 0:
            raise ValueError("--kl-coef, --kl-loss-coef and --loss-scale-tokens must be >= 0")

    @property
    def needs_reference(self) -> bool:
        """A KL term or penalty against the initial policy: the trainer keeps a frozen reference model."""
        return bool(self.kl_loss_coef or self.kl_coef)


def check_estimator(estimator: str, loss: PolicyLossConfig) -> None:
    """ValueError unless ``estimator`` is known and the loss settings make sense with it. ``--kl-coef``
    changed meaning in issue 31 (it was the KL loss term, now ``--kl-loss-coef``): with an estimator that
    has no reward to fold it into, it is refused with the new name rather than ignored."""
    known = typing.get_args(AdvantageEstimator)
    if estimator not in known:
        raise ValueError(f"--advantage-estimator (or --algo) must be one of {', '.join(known)}, not {estimator!r}")
    if loss.kl_coef and estimator not in REWARD_KL_ESTIMATORS:
        raise ValueError(f"--kl-coef is the KL penalty folded into the reward (slime's meaning), which "
                         f"{estimator} has no per-token reward for (only {', '.join(REWARD_KL_ESTIMATORS)}); "
                         "for a KL term in the loss -- vime's --kl-coef before issue 31 -- pass --kl-loss-coef")
