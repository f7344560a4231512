"""REINFORCE++ and REINFORCE++-baseline (Hu, 2025), as OpenRLHF defines them.

No value model. Each token's reward is ``-kl_coef * kl_t`` (the KL to the
reference folded into the reward, ``--kl-coef``), and the response's reward
is added on its last token; the advantage of a token is its discounted
return ``G_t = sum_{k >= t} gamma^(k - t) r_k``, whitened over every real
token of the batch (mean 0, population std 1: ``ppo.whiten``).

REINFORCE++-baseline first subtracts the group's mean reward from each
response's (no std division: the batch whitening scales), then does the
same. The returns are GAE with zero values and ``lam = 1``: one piece of
code walks the tokens, holes in the mask (tool messages) included.

Conventions where the peers differ:

* the KL penalty is part of the return, so a token's advantage carries the
  penalties of every later token (OpenRLHF); slime's REINFORCE++-baseline
  subtracts only the token's own ``kl_coef * kl_t`` from the centred reward
  (no sum), and verl's has no KL in the reward at all. With ``--kl-coef 0``
  (the default) all three agree;
* the penalty's estimator is ``--kl-estimator`` (default k3), the same one
  as the KL loss term's; OpenRLHF's reward penalty defaults to k1;
* a batch whose returns are all equal whitens to exactly 0 (``ppo.whiten``);
  the peers give every token the same small push there.
"""

from __future__ import annotations

import torch

from vime.algorithms.grpo import GRPOConfig, group_advantages
from vime.algorithms.ppo import gae, terminal_rewards, whiten


def reinforce_plus_plus(rewards: torch.Tensor, mask: torch.Tensor, gamma: float,
                        kl_penalty: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token advantages ``[samples, tokens]`` from rewards ``[samples]``; ``kl_penalty`` is
    ``kl_coef * kl`` per token (subtracted from the token rewards), None for none. A batch whose returns
    are all equal whitens to 0."""
    token_rewards = terminal_rewards(rewards, mask)
    if kl_penalty is not None:
        token_rewards = token_rewards - kl_penalty  # padding's never counts: gae skips it
    returns, _ = gae(token_rewards, torch.zeros_like(token_rewards), mask, gamma, 1.0)
    return whiten(returns, mask)


def reinforce_plus_plus_baseline(rewards: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor, gamma: float,
                                 kl_penalty: torch.Tensor | None = None) -> torch.Tensor:
    """REINFORCE++ on group-centred rewards. A group of equal rewards is centred to exactly 0, but after the
    batch whitening its tokens carry the batch's shift like any other (OpenRLHF's definition)."""
    centred = group_advantages(rewards, group_ids, GRPOConfig(normalize_std=False))
    return reinforce_plus_plus(centred, mask, gamma, kl_penalty)
