"""PPO with a value model: GAE advantages and the clipped value loss.

The reward of a response is given at its last token; every other token's
immediate reward is 0, less the KL penalty ``kl_coef * kl_t`` when
``--kl-coef`` folds one in (verl's ``compute_rewards``, slime's
``--kl-coef``; distinct from the loss term ``--kl-loss-coef``). Advantages come from GAE(γ, λ) over the response
tokens and are whitened over the batch; returns are advantages + values. The
value loss is clipped around the values the value model gave at the start
of the training step (``value_clip``), as in OpenAI baselines' PPO.
"""

from __future__ import annotations

import torch

from vime.algorithms.config import PPOConfig


def terminal_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token rewards ``[samples, tokens]``: each sample's reward on its last real token (the last one
    the mask keeps: inserted tool messages may sit between real tokens)."""
    per_token = torch.zeros_like(mask, dtype=torch.float32)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, -1).max(-1).values
    rows = torch.arange(mask.shape[0], device=mask.device)
    per_token[rows, last.clamp(min=0)] = rewards.to(torch.float32) * (last >= 0)
    return per_token


def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimates and returns, both ``[samples, tokens]``.

    The value after the last real token is 0 (the episode ends there);
    padding contributes nothing. Masked positions between real tokens
    (inserted tool messages) are not steps: the real token before them
    continues from the real token after them, as if they were not there.
    """
    advantages = torch.zeros_like(token_rewards)
    running = torch.zeros(token_rewards.shape[0], device=token_rewards.device)
    next_value = torch.zeros_like(running)
    for t in reversed(range(token_rewards.shape[1])):
        live = mask[:, t] > 0
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(live, delta + gamma * lam * running, running)
        advantages[:, t] = running * live
        next_value = torch.where(live, values[:, t], next_value)
    return advantages, (advantages + values) * mask


def whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Shift and scale to mean 0, std 1 over the masked entries: the population std (divided by the count,
    not count - 1), as OpenRLHF, verl and slime whiten; ``eps`` is added to the variance (OpenRLHF clamps
    the variance to at least ``eps`` instead: the same but for a variance below ``eps``).

    Masked entries that are all equal whiten to exactly 0, as an equal group does in ``grpo``: their
    computed mean can be a rounding step off the common value (seven returns of 0.1 in fp32), and divided
    by ``sqrt(eps)`` that step becomes 1.5e-4 for every token, pushing the whole batch one way. OpenRLHF,
    verl and slime keep that flaw."""
    count = mask.sum().clamp(min=1)
    mean = (values * mask).sum() / count
    variance = (((values - mean) * mask) ** 2).sum() / count
    whitened = (values - mean) * torch.rsqrt(variance + eps) * mask
    live = mask > 0
    highest = torch.where(live, values, -torch.inf).max()
    lowest = torch.where(live, values, torch.inf).min()
    return torch.where(highest == lowest, torch.zeros_like(whitened), whitened)


def advantages_and_returns(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, config: PPOConfig,
                           kl_penalty: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages (whitened when configured) and value targets for one batch; ``kl_penalty`` is
    ``kl_coef * kl`` per token, subtracted from the token rewards (None: none). The returns are not
    whitened: they are the value model's targets."""
    token_rewards = terminal_rewards(rewards, mask)
    if kl_penalty is not None:
        token_rewards = token_rewards - kl_penalty  # padding's never counts: gae skips it
    advantages, returns = gae(token_rewards, values, mask, config.gamma, config.lam)
    if config.whiten_advantages:
        advantages = whiten(advantages, mask)
    return advantages, returns


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               value_clip: float, normalizer: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss: 0.5 * max((V - R)^2, (V_clipped - R)^2), token-averaged; its clip fraction is a
    scalar tensor, like the policy loss's statistics. The 0.5 is OpenAI baselines' and verl's (OpenRLHF's
    too); with ``--value-coef`` 0.5 on top the value loss weighs a quarter of the squared error."""
    clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    losses = torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    denominator = normalizer if normalizer is not None else mask.sum().clamp(min=1)
    loss = 0.5 * (losses * mask).sum() / denominator
    clipfrac = (((clipped - returns) ** 2 > (values - returns) ** 2).float() * mask).sum() / mask.sum().clamp(min=1)
    return loss, {"vf_clipfrac": clipfrac}
