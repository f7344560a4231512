"""RLOO advantages (Ahmadian et al., 2024): each sample against the mean of the rest of its group.

``A_i = r_i - mean_{j != i} r_j``, which is ``n / (n - 1)`` times the
group-centred reward: an unbiased baseline (it does not depend on the sample
it is subtracted from), with no std scaling. Like GRPO, one advantage per
response, broadcast over its tokens; no value model, no KL in the reward.
"""

from __future__ import annotations

import torch

from vime.algorithms.grpo import GRPOConfig, group_advantages, group_index


def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Per-sample leave-one-out advantages ``[samples]``, float32. A group of one has no other sample to
    compare with and gets 0 (OpenRLHF would divide by zero); a group of equal rewards gets exactly 0."""
    index, counts = group_index(group_ids)
    sizes = counts.to(torch.float32)[index].to(rewards.device)
    centred = group_advantages(rewards, group_ids, GRPOConfig(normalize_std=False))
    return centred * sizes / (sizes - 1).clamp(min=1)
