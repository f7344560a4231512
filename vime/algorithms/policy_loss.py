"""The clipped policy-gradient surrogate, its aggregation, KL and entropy terms.

Shared by GRPO and PPO. Departures from the papers are named where they are:
ε-low/ε-high (DAPO's clip-higher) replace PPO's single ε; aggregation is
either over all tokens of the batch (DAPO, token-level) or per sequence first
(the original GRPO).
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    """Settings of the surrogate loss, common to every algorithm."""

    clip_low: float = 0.2  # ratio floor is 1 - clip_low
    clip_high: float = 0.2  # ratio ceiling is 1 + clip_high (DAPO uses 0.28)
    loss_aggregation: str = "token"  # "token": mean over all tokens of the batch; "sequence": per sequence first
    kl_coef: float = 0.0  # > 0 keeps a frozen reference model and penalises KL to it
    kl_estimator: str = "k3"  # "k1": log p - log p_ref; "k3": Schulman's unbiased, always >= 0
    entropy_coef: float = 0.0  # > 0 rewards entropy (a bonus, subtracted from the loss)

    def __post_init__(self) -> None:
        if self.loss_aggregation not in ("token", "sequence"):
            raise ValueError(f"loss_aggregation must be token or sequence, not {self.loss_aggregation!r}")
        if self.kl_estimator not in ("k1", "k3"):
            raise ValueError(f"kl_estimator must be k1 or k3, not {self.kl_estimator!r}")
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ValueError("clip_low must be in [0, 1) and clip_high >= 0")


def aggregate(values: torch.Tensor, mask: torch.Tensor, aggregation: str, normalizer: float | None = None) -> torch.Tensor:
    """Reduce per-token ``values`` to a scalar.

    ``normalizer`` is the denominator for the whole batch (token count for
    "token", sequence count for "sequence"). Micro-batches pass the batch's
    figure so that accumulated gradients equal those of one big batch.
    """
    if aggregation == "token":
        return (values * mask).sum() / (normalizer if normalizer is not None else mask.sum().clamp(min=1))
    per_sequence = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_sequence.sum() / (normalizer if normalizer is not None else values.shape[0])


def clipped_surrogate(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                      clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO surrogate loss (to minimise) and whether each token was clipped."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    return -torch.minimum(unclipped, clipped), (clipped < unclipped).float()


def kl_divergence(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled-token log-probs."""
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    return torch.exp(log_ratio) - log_ratio - 1.0


def policy_loss(config: PolicyLossConfig, logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                advantages: torch.Tensor, mask: torch.Tensor, *, entropy: torch.Tensor | None = None,
                ref_logprobs: torch.Tensor | None = None,
                normalizer: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The full policy loss with its optional KL and entropy terms, and its statistics."""
    per_token, was_clipped = clipped_surrogate(logprobs, old_logprobs, advantages, config.clip_low, config.clip_high)
    stats = {"pg_clipfrac": float(aggregate(was_clipped, mask, "token"))}
    if config.kl_coef:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs the reference model's log-probs")
        kl = kl_divergence(logprobs, ref_logprobs, config.kl_estimator)
        per_token = per_token + config.kl_coef * kl
        stats["kl"] = float(aggregate(kl.detach(), mask, "token"))
    if config.entropy_coef:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs the per-token entropy")
        per_token = per_token - config.entropy_coef * entropy
    return aggregate(per_token, mask, config.loss_aggregation, normalizer), stats
