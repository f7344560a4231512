"""Per-token estimators of KL(policy || reference) from the sampled tokens' log-probs.

With ``log r = log p_ref - log p`` at a token sampled from the policy
(Schulman, "Approximating KL divergence", 2020):

* ``k1 = -log r``: unbiased, can be negative;
* ``k2 = (log r)^2 / 2``: biased, always >= 0, low variance near 0;
* ``k3 = r - 1 - log r``: unbiased, always >= 0;
* ``low_var_kl``: k3 with ``log r`` clamped to [-20, 20] and the result to
  [-10, 10], as verl and slime compute it (the clamps keep one far-off token
  from dominating; the gradient is 0 where a clamp holds).

The same estimator serves the KL loss term (``--kl-loss-coef``) and the KL
penalty folded into the reward (``--kl-coef``). The peers choose apart: verl
takes one setting per term (``algorithm.kl_penalty`` for the reward,
``actor.kl_loss_type`` for the loss) and OpenRLHF's reward penalty defaults
to k1; with vime's one ``--kl-estimator`` a run cannot have, say, k1 in the
reward and low_var_kl in the loss.
"""

from __future__ import annotations

import torch

from vime.algorithms.config import KlEstimator


def kl_divergence(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KlEstimator) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) by ``estimator`` (see above)."""
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio ** 2
    if estimator == "low_var_kl":
        log_ratio = log_ratio.clamp(-20.0, 20.0)
        return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-10.0, 10.0)
    return torch.exp(log_ratio) - log_ratio - 1.0
