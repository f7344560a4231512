"""GRPO advantages: each sample's reward against its group's.

The advantage of every token of a response is its group-normalised reward,
``(r - mean(group)) / (std(group) + eps)``. With ``normalize_std=False`` the
division is skipped, as Dr.GRPO proposes (it removes the question-difficulty
bias that std scaling introduces). The loss is the shared clipped surrogate
(``policy_loss``); GRPO itself has no value model. ``--advantage-estimator
gspo`` takes these advantages too and changes only the ratio (see
``policy_loss``).
"""

from __future__ import annotations

import torch

from vime.algorithms.config import GRPOConfig


def group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each sample, the position of its group among the batch's groups (``[samples]``), and each
    group's size (``[groups]``). Group ids may be any integers, in any order."""
    _, index, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    return index, counts


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, config: GRPOConfig) -> torch.Tensor:
    """Per-sample advantages from rewards ``[samples]`` and their group ids ``[samples]``, float32.

    Conventions where the peers differ:

    * the std is the unbiased sample std (``n - 1``), as the GRPO paper's
      implementations take it (verl, slime, TRL), and ``std_eps`` is added
      to it, not to the variance;
    * a group whose rewards are all equal -- a group of one among them --
      gets advantage exactly 0. Computed, its mean can be one rounding step
      off the common value (eight rewards of 0.1 in fp32), and divided by a
      std of 0 + eps that step becomes -0.0074 for every sample, pushing the
      whole group one way; verl and slime keep that flaw, vime does not.
    """
    values = rewards.to(torch.float32)
    index, counts = group_index(group_ids.to(values.device))
    counts = counts.to(values.device)
    groups = counts.numel()
    mean = torch.zeros(groups, device=values.device).index_add_(0, index, values) / counts
    centred = values - mean[index]
    if config.normalize_std:
        squares = torch.zeros(groups, device=values.device).index_add_(0, index, centred ** 2)
        std = (squares / (counts - 1).clamp(min=1)).sqrt()
        centred = centred / (std[index] + config.std_eps)
    highest = torch.full((groups,), -torch.inf, device=values.device).scatter_reduce(0, index, values, "amax")
    lowest = torch.full((groups,), torch.inf, device=values.device).scatter_reduce(0, index, values, "amin")
    return torch.where((highest == lowest)[index], torch.zeros_like(centred), centred)


def token_advantages(sample_advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Broadcast one advantage per sample over its response tokens."""
    return sample_advantages.unsqueeze(-1) * mask
