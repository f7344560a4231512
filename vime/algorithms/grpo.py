"""GRPO advantages: each sample's reward against its group's.

The advantage of every token of a response is its group-normalised reward,
``(r - mean(group)) / (std(group) + eps)``. With ``normalize_std=False`` the
division is skipped, as Dr.GRPO proposes (it removes the question-difficulty
bias that std scaling introduces). The loss is the shared clipped surrogate
(``policy_loss``); GRPO itself has no value model.
"""

from __future__ import annotations

import dataclasses

import torch

from vime.settings import setting


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    normalize_std: bool = setting(True, "False: Dr.GRPO (centre only)")
    std_eps: float = setting(1e-6, "added to the group's reward std before dividing")


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, config: GRPOConfig) -> torch.Tensor:
    """Per-sample advantages from rewards ``[samples]`` and their group ids ``[samples]``.

    Groups may be of any size and in any order; the std is the unbiased
    sample std (as in the GRPO paper's implementations), 0 for a group of one.
    """
    advantages = torch.empty_like(rewards, dtype=torch.float32)
    for group in torch.unique(group_ids):
        members = group_ids == group
        values = rewards[members].to(torch.float32)
        centred = values - values.mean()
        if config.normalize_std:
            std = values.std() if values.numel() > 1 else torch.zeros(())
            centred = centred / (std + config.std_eps)
        advantages[members] = centred
    return advantages


def token_advantages(sample_advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Broadcast one advantage per sample over its response tokens."""
    return sample_advantages.unsqueeze(-1) * mask
