"""The policy-gradient surrogate, its aggregation, and the KL, entropy and correction terms.

Shared by every advantage estimator. Departures from the papers are named
where they are: ε-low/ε-high (DAPO's clip-higher) replace PPO's single ε.

``--policy-loss``:

* ``ppo`` -- the clipped surrogate ``-min(r A, clip(r, 1 - ε_low, 1 + ε_high) A)``;
  with ``--dual-clip-c c`` (> 1; Ye et al., 2020; slime's ``eps_clip_c``,
  verl's ``clip_ratio_c``) a token with ``A < 0`` loses at most ``-c A``,
  however large its ratio (``pg_clipfrac_lower`` counts those tokens);
* ``cispo`` -- MiniMax-M1's CISPO: REINFORCE with the importance weight
  clipped and detached, ``-sg(clip(r, 1 - ε_low, 1 + ε_high)) A log pi``, so
  every token keeps a gradient (PPO's clip drops it). MiniMax leaves the
  floor off (ε_low near 1) and tunes only ε_high. Token ratios only.

``ratio_level="sequence"`` is GSPO (Zheng et al., 2025; ``--advantage-estimator
gspo`` implies it): every token of a response shares the response's ratio,
the geometric mean of its token ratios ``exp(mean_t(log pi - log pi_old))``,
which is what is clipped (GSPO clips tightly: slime's GLM-4.5 scripts use
1e-4 / 2e-4). Its gradient is the ratio times the mean token score, written
per token as ``sg[s] * pi / sg[pi]``. The paper's objective averages per
sequence (``--loss-aggregation sequence``); with token aggregation each
response weighs by its length: a length-weighted GSPO, as slime runs it.

``--loss-aggregation`` reduces per-token losses ``l`` (with ``|y_i|`` the
real tokens of response ``i``, ``N`` the responses, ``L`` a constant):

* ``token`` -- ``sum_i sum_t l / sum_i |y_i|`` (DAPO: every token alike);
* ``sequence`` -- ``mean_i (sum_t l / |y_i|)`` (the original GRPO);
* ``seq-mean-token-sum`` -- ``mean_i sum_t l`` (long responses weigh more);
* ``seq-mean-token-sum-norm`` -- ``sum_i sum_t l / (N L)``, Dr.GRPO's
  constant normaliser: ``L`` is ``--loss-scale-tokens`` (by default the
  longest response the run generates), so no response is weighted by its
  own length. verl before its global-batch rework divided the token sums by
  ``L`` alone (``sum_i sum_t l / L``, a loss that grows with the batch) and
  takes the batch's padded width as ``L`` unless told; vime divides by
  ``N L`` as the Dr.GRPO paper's objective and today's verl do.

A response with no real token (an empty mask row) adds 0 to the sum but
still counts as one of the ``N`` responses in the three per-sequence modes
(as in verl); the batch's normaliser is what makes micro-batches add up.

The off-policy corrections (``vime.algorithms.corrections``) multiply the
per-token surrogate; the KL loss term (``--kl-loss-coef``) and the entropy
bonus are added per token, before aggregation.
"""

from __future__ import annotations

import torch

from vime.algorithms.config import LossAggregation, PolicyLossConfig
from vime.algorithms.corrections import importance_weights
from vime.algorithms.kl import kl_divergence


def batch_normalizer(aggregation: LossAggregation, sequences: float, tokens: float | torch.Tensor,
                     scale_tokens: float) -> float | torch.Tensor:
    """The denominator of :func:`aggregate` for a whole (mini-)batch of ``sequences`` responses holding
    ``tokens`` real tokens (at least 1): micro-batches pass it so that their accumulated gradients equal those of one
    big batch. ``scale_tokens`` is seq-mean-token-sum-norm's constant per response."""
    if aggregation == "token":
        return tokens
    if aggregation == "seq-mean-token-sum-norm":
        return sequences * scale_tokens
    return sequences


def aggregate(values: torch.Tensor, mask: torch.Tensor, aggregation: LossAggregation,
              normalizer: float | None = None) -> torch.Tensor:
    """Reduce per-token ``values`` to a scalar as ``aggregation`` says (see the module's docstring).

    ``normalizer`` is the denominator for the whole batch (:func:`batch_normalizer`); without it, this
    batch's own, with the mask's width as seq-mean-token-sum-norm's constant (verl's default).
    """
    if normalizer is None:
        normalizer = batch_normalizer(aggregation, values.shape[0], mask.sum().clamp(min=1), values.shape[-1])
    if aggregation in ("token", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        return (values * mask).sum() / normalizer
    per_sequence = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_sequence.sum() / normalizer


def ratios(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor | None = None,
           level: str = "token") -> torch.Tensor:
    """``pi / pi_old`` per token; with ``level="sequence"`` (GSPO, needs ``mask``) each response's geometric
    mean ratio, shared by its tokens, with the gradient of the mean token score."""
    if level == "sequence":
        log_ratio = ((logprobs - old_logprobs) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        return torch.exp(log_ratio.detach() + logprobs - logprobs.detach())
    return torch.exp(logprobs - old_logprobs)


def ratio_anchor(config: PolicyLossConfig, old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                 stale: torch.Tensor) -> torch.Tensor:
    """The log-probs each token's ratio is taken against: the trainer's recomputed ``old_logprobs`` (the
    proximal policy), except for ``stale`` tokens (sampled by weights older than the trainer's) with
    ``stale_ratio="behaviour"`` and no off-policy correction, which take the ``behaviour_logprobs`` they were
    sampled with.

    Why: against the proximal policy a stale token's ratio starts every step at 1, so the clip never sees how
    far the policy has already moved from the one that sampled it, and its advantage (measured among that
    policy's responses) keeps pushing, step after step, in the direction it was already taken. A wrong answer
    whose probability has all but vanished is still pushed down with the full gradient of its log-prob (1 -
    p, about 1), which sharpens every logit of the shared network; a right one already near certainty is
    pushed up again. Entropy then collapses before the slower prompts are learned, and a prompt collapsed on a
    wrong answer gives all-equal rewards (advantage 0) from then on: the asynchronous plateau of issue 30.
    Against the behaviour log-probs the clip is PPO's trust region around the sampling policy: a token that
    has already moved by more than the clip in its advantage's direction adds no gradient (under PPO's loss;
    CISPO keeps a clipped weight's gradient, so there the anchor only caps it).

    Not for sequence-level ratios (GSPO): its clip is ~1e-4 wide, the anchor would mix per token within a
    partial rollout, and a fully stale response would carry the engines' own mismatch inside it; nor where the
    rollout's log-probs are of a truncated distribution (``RunConfig.train_engine_arguments``)."""
    if config.stale_ratio == "proximal" or config.off_policy_correction != "none" or config.ratio_level == "sequence":
        return old_logprobs
    return torch.where(stale, behaviour_logprobs, old_logprobs)


def clipped_surrogate(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                      clip_low: float, clip_high: float, mask: torch.Tensor | None = None,
                      level: str = "token") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO surrogate loss (to minimise) and whether each token was clipped; with
    ``level="sequence"`` (GSPO, needs ``mask``) the ratio is each response's, shared by its tokens."""
    ratio = ratios(logprobs, old_logprobs, mask, level)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    return -torch.minimum(unclipped, clipped), (clipped < unclipped).float()


def dual_clip(per_token: torch.Tensor, advantages: torch.Tensor, c: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The clipped surrogate's loss bounded by ``-c A`` where ``A < 0`` (no gradient there), and which tokens
    the bound held. Where ``A >= 0`` nothing changes."""
    bound = -c * advantages
    engaged = (advantages < 0) & (per_token > bound)
    return torch.where(engaged, bound, per_token), engaged.float()


def cispo_surrogate(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                    clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token CISPO loss and whether each token's weight was clipped. Written ``-sg(w) A pi / sg(pi)``:
    its gradient is MiniMax-M1's ``-sg(w) A grad log pi``, and its value ``-w A`` reads like the
    surrogate's (``-w A log pi`` would report the log-probs' scale instead)."""
    ratio = torch.exp(logprobs - old_logprobs).detach()
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return -weight * advantages * torch.exp(logprobs - logprobs.detach()), (weight != ratio).float()


def policy_loss(config: PolicyLossConfig, logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                advantages: torch.Tensor, mask: torch.Tensor, *, entropy: torch.Tensor | None = None,
                ref_logprobs: torch.Tensor | None = None, behaviour_logprobs: torch.Tensor | None = None,
                normalizer: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The full policy loss with its optional correction, KL and entropy terms, and its statistics: detached
    scalar tensors, per-token fractions and means, read once per step by the caller, because reading each one
    here would make the host wait for the device on every micro-batch. ``normalizer``: see
    :func:`batch_normalizer`; without it, this batch's own, with ``loss_scale_tokens`` (or the mask's width)
    as seq-mean-token-sum-norm's constant."""
    if config.policy_loss == "cispo":
        per_token, was_clipped = cispo_surrogate(logprobs, old_logprobs, advantages, config.clip_low,
                                                 config.clip_high)
    else:
        per_token, was_clipped = clipped_surrogate(logprobs, old_logprobs, advantages, config.clip_low,
                                                   config.clip_high, mask, config.ratio_level)
    stats = {"pg_clipfrac": aggregate(was_clipped, mask, "token")}
    if config.dual_clip_c:
        per_token, lower = dual_clip(per_token, advantages, config.dual_clip_c)
        stats["pg_clipfrac_lower"] = aggregate(lower, mask, "token")
    if config.off_policy_correction != "none":
        if behaviour_logprobs is None:
            raise ValueError(f"off_policy_correction={config.off_policy_correction} needs the rollout log-probs")
        weights, changed = importance_weights(old_logprobs, behaviour_logprobs, mask, config.off_policy_correction,
                                              cap=config.tis_cap, floor=config.tis_floor, level=config.tis_level)
        per_token = per_token * weights
        stats["tis"] = aggregate(weights, mask, "token")
        stats["tis_clipfrac" if config.off_policy_correction == "tis" else "tis_maskfrac"] = \
            aggregate(changed, mask, "token")
    if config.kl_loss_coef:
        if ref_logprobs is None:
            raise ValueError("kl_loss_coef > 0 needs the reference model's log-probs")
        kl = kl_divergence(logprobs, ref_logprobs, config.kl_estimator)
        per_token = per_token + config.kl_loss_coef * kl
        stats["kl"] = aggregate(kl.detach(), mask, "token")
    if config.entropy_coef:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs the per-token entropy")
        per_token = per_token - config.entropy_coef * entropy
    if normalizer is None:
        normalizer = batch_normalizer(config.loss_aggregation, mask.shape[0], mask.sum().clamp(min=1),
                                      config.loss_scale_tokens or mask.shape[-1])
    return aggregate(per_token, mask, config.loss_aggregation, normalizer), stats
