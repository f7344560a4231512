"""``--advantage-estimator``: which advantages a batch trains on (slime's flag and values).

=============================  ==============================================================  ===========
estimator                      advantage of each token                                         value model
=============================  ==============================================================  ===========
grpo                           the response's group-normalised reward (``grpo``)                no
gspo                           as grpo, with GSPO's sequence-level ratio in the loss            no
rloo                           the reward less the mean of the rest of its group (``rloo``)     no
reinforce_plus_plus            discounted return of KL-penalised token rewards, whitened        no
reinforce_plus_plus_baseline   as reinforce_plus_plus on group-centred rewards                  no
ppo                            GAE over the value model's values, whitened (``ppo``)            yes
=============================  ==============================================================  ===========

``--kl-coef`` (a KL penalty in the reward) has a meaning only for the
estimators whose advantages are built from per-token rewards: ppo and the
two REINFORCE++ forms; the estimators' names and that check are in
``vime.algorithms.config``, which the command line reads without torch.
Both trainer backends call :func:`advantages`, so they cannot drift apart.
"""

from __future__ import annotations

import dataclasses

import torch

from vime.algorithms import grpo, ppo
from vime.algorithms.config import AdvantageEstimator, PolicyLossConfig
from vime.algorithms.reinforce import reinforce_plus_plus, reinforce_plus_plus_baseline
from vime.algorithms.rloo import rloo_advantages


def loss_settings(estimator: AdvantageEstimator, loss: PolicyLossConfig) -> PolicyLossConfig:
    """The loss settings the trainer uses: gspo is grpo with the sequence-level ratio."""
    return dataclasses.replace(loss, ratio_level="sequence") if estimator == "gspo" else loss


def advantages(estimator: AdvantageEstimator, rewards: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor, *,
               grpo_config: grpo.GRPOConfig, ppo_config: ppo.PPOConfig, values: torch.Tensor | None = None,
               kl_penalty: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token advantages ``[samples, tokens]`` and, for ppo, the value model's targets (else None).
    ``values``: the value model's, for ppo; ``kl_penalty``: ``kl_coef * kl`` per token, for the estimators
    of ``vime.algorithms.config.REWARD_KL_ESTIMATORS`` (None: no penalty)."""
    if estimator in ("grpo", "gspo"):
        return grpo.token_advantages(grpo.group_advantages(rewards, group_ids, grpo_config), mask), None
    if estimator == "rloo":
        return grpo.token_advantages(rloo_advantages(rewards, group_ids), mask), None
    if estimator == "reinforce_plus_plus":
        return reinforce_plus_plus(rewards, mask, ppo_config.gamma, kl_penalty), None
    if estimator == "reinforce_plus_plus_baseline":
        return reinforce_plus_plus_baseline(rewards, group_ids, mask, ppo_config.gamma, kl_penalty), None
    if values is None:
        raise ValueError("ppo's advantages need the value model's values")
    return ppo.advantages_and_returns(rewards, values, mask, ppo_config, kl_penalty)
