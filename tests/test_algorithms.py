"""Algorithm modules against hand-computed values and their formulas: GRPO, RLOO, REINFORCE++, PPO/GAE,
the policy losses, KL, aggregation, off-policy corrections, dynamic sampling.

Every expected number is worked out in the test itself with plain arithmetic,
never by calling the function under test another way. CPU only, well under a
second.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from vime.algorithms.config import REWARD_KL_ESTIMATORS, check_estimator
from vime.algorithms.corrections import importance_weights
from vime.algorithms.dynamic_sampling import is_informative
from vime.algorithms.estimators import advantages as estimator_advantages
from vime.algorithms.estimators import loss_settings
from vime.algorithms.grpo import GRPOConfig, group_advantages, token_advantages
from vime.algorithms.kl import kl_divergence
from vime.algorithms.policy_loss import (
    PolicyLossConfig,
    aggregate,
    batch_normalizer,
    clipped_surrogate,
    dual_clip,
    policy_loss,
    ratio_anchor,
)
from vime.algorithms.ppo import PPOConfig, advantages_and_returns, gae, terminal_rewards, value_loss, whiten
from vime.algorithms.reinforce import reinforce_plus_plus, reinforce_plus_plus_baseline
from vime.algorithms.rloo import rloo_advantages


def tensor(values: object) -> torch.Tensor:
    """A float32 tensor from nested lists of Python numbers."""
    return torch.tensor(values, dtype=torch.float32)


def close(actual: torch.Tensor, expected: object) -> None:
    assert_close(actual, tensor(expected))


# --- GRPO -------------------------------------------------------------------------------------------

EPS = GRPOConfig().std_eps


def test_group_advantages_one_group_uses_unbiased_std() -> None:
    # mean 1/3; centred [2/3, -1/3, -1/3]; unbiased variance (4/9 + 1/9 + 1/9) / (3 - 1) = 1/3.
    std = math.sqrt(1 / 3)
    advantages = group_advantages(tensor([1.0, 0.0, 0.0]), torch.tensor([7, 7, 7]), GRPOConfig())
    close(advantages, [(2 / 3) / (std + EPS), (-1 / 3) / (std + EPS), (-1 / 3) / (std + EPS)])
    # The biased std, sqrt(2/9), would give 2/3 / 0.4714 = 1.414 for the first sample instead.
    assert advantages[0].item() == pytest.approx(1.1547, abs=1e-4)


def test_group_advantages_groups_in_any_order_and_a_group_of_one() -> None:
    # group 1: rewards 2, 4, 6  -> mean 4, centred -2, 0, 2, unbiased std sqrt(8 / 2) = 2
    # group 3: rewards 5, 1     -> mean 3, centred  2, -2,   unbiased std sqrt(8 / 1) = sqrt(8)
    # group 0: reward 9 alone   -> centred 0, std 0 -> advantage 0
    group_ids = torch.tensor([1, 3, 0, 1, 3, 1])
    rewards = tensor([2, 5, 9, 4, 1, 6])
    s1, s3 = 2 + EPS, math.sqrt(8) + EPS
    close(group_advantages(rewards, group_ids, GRPOConfig()), [-2 / s1, 2 / s3, 0.0, 0 / s1, -2 / s3, 2 / s1])


def test_group_advantages_dr_grpo_only_centres() -> None:
    group_ids = torch.tensor([1, 3, 0, 1, 3, 1])
    rewards = tensor([2, 5, 9, 4, 1, 6])
    close(group_advantages(rewards, group_ids, GRPOConfig(normalize_std=False)), [-2, 2, 0, 0, -2, 2])


def test_group_advantages_accepts_integer_rewards_and_returns_float32() -> None:
    advantages = group_advantages(torch.tensor([0, 1]), torch.tensor([0, 0]), GRPOConfig(normalize_std=False))
    assert advantages.dtype == torch.float32
    close(advantages, [-0.5, 0.5])


def test_group_advantages_adds_eps_to_the_std() -> None:
    # rewards 0, 1: centred -0.5, 0.5; unbiased std sqrt(0.5); a large eps shows where it is added.
    std = math.sqrt(0.5)
    advantages = group_advantages(tensor([0.0, 1.0]), torch.tensor([0, 0]), GRPOConfig(std_eps=0.5))
    close(advantages, [-0.5 / (std + 0.5), 0.5 / (std + 0.5)])


def test_group_advantages_equal_rewards_give_zero() -> None:
    advantages = group_advantages(tensor([1.0, 1.0, 3.0, 3.0]), torch.tensor([0, 0, 1, 1]), GRPOConfig())
    close(advantages, [0, 0, 0, 0])


def test_token_advantages_broadcasts_over_the_response_mask() -> None:
    mask = tensor([[1, 1, 0], [1, 0, 0]])
    close(token_advantages(tensor([2.0, -1.0]), mask), [[2, 2, 0], [-1, 0, 0]])


# --- PPO --------------------------------------------------------------------------------------------


def test_terminal_rewards_land_on_each_samples_last_real_token() -> None:
    mask = tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0], [1, 0, 1], [1, 1, 0]])
    close(terminal_rewards(tensor([1.0, -0.5, 3.0, 2.0, 4.0]), mask),
          [[0, 0, 1], [-0.5, 0, 0], [0, 0, 0], [0, 0, 2], [0, 4, 0]])


def test_gae_steps_over_inserted_tokens_as_if_they_were_not_there() -> None:
    """A tool message between two turns is no step: GAE over a mask with holes equals GAE over the
    sequence with the masked positions cut out (their values and rewards, whatever they are, unused)."""
    generator = torch.Generator().manual_seed(0)
    mask = tensor([[1, 1, 0, 0, 0, 1, 1, 0], [1, 0, 1, 0, 1, 1, 1, 1]])
    values = torch.randn(mask.shape, generator=generator)
    rewards = terminal_rewards(tensor([1.0, -2.0]), mask)
    advantages, returns = gae(rewards, values, mask, GAMMA, LAM)
    for row in range(2):
        kept = mask[row] > 0
        alone, alone_returns = gae(rewards[row][kept][None], values[row][kept][None], mask[row][kept][None],
                                   GAMMA, LAM)
        close(advantages[row][kept][None], alone.tolist())
        close(returns[row][kept][None], alone_returns.tolist())
        assert not advantages[row][~kept].any() and not returns[row][~kept].any()


GAMMA, LAM = 0.9, 0.8
# Sample 0: three tokens, reward 1 at the end, values 0.5, 0.2, 0.4.
A0_2 = 1 + GAMMA * 0 - 0.4                                  # 0.6 (value after the last token is 0)
A0_1 = (0 + GAMMA * 0.4 - 0.2) + GAMMA * LAM * A0_2         # 0.16 + 0.72 * 0.6 = 0.592
A0_0 = (0 + GAMMA * 0.2 - 0.5) + GAMMA * LAM * A0_1         # -0.32 + 0.72 * 0.592 = 0.10624
# Sample 1: two tokens then padding (whose value 9 must be ignored), reward 2, values 1.0, 0.5.
A1_1 = 2 + GAMMA * 0 - 0.5                                  # 1.5
A1_0 = (0 + GAMMA * 0.5 - 1.0) + GAMMA * LAM * A1_1         # -0.55 + 1.08 = 0.53
GAE_VALUES = [[0.5, 0.2, 0.4], [1.0, 0.5, 9.0]]
GAE_MASK = [[1, 1, 1], [1, 1, 0]]
GAE_ADVANTAGES = [[A0_0, A0_1, A0_2], [A1_0, A1_1, 0.0]]
GAE_RETURNS = [[A0_0 + 0.5, A0_1 + 0.2, A0_2 + 0.4], [A1_0 + 1.0, A1_1 + 0.5, 0.0]]


def test_gae_with_gamma_and_lambda_and_masks_of_different_lengths() -> None:
    token_rewards = tensor([[0, 0, 1], [0, 2, 0]])
    advantages, returns = gae(token_rewards, tensor(GAE_VALUES), tensor(GAE_MASK), GAMMA, LAM)
    assert advantages[0, 0].item() == pytest.approx(0.10624, abs=1e-6)
    close(advantages, GAE_ADVANTAGES)
    close(returns, GAE_RETURNS)


def test_gae_lambda_one_is_monte_carlo_and_lambda_zero_is_td() -> None:
    token_rewards = tensor([[0, 0, 1]])
    values = tensor([[0.5, 0.2, 0.4]])
    mask = tensor([[1, 1, 1]])
    advantages, returns = gae(token_rewards, values, mask, gamma=1.0, lam=1.0)
    close(advantages, [[1 - 0.5, 1 - 0.2, 1 - 0.4]])  # return-to-go 1 minus the value
    close(returns, [[1, 1, 1]])
    advantages, _ = gae(token_rewards, values, mask, gamma=1.0, lam=0.0)
    close(advantages, [[0.2 - 0.5, 0.4 - 0.2, 1 - 0.4]])  # one-step TD errors


def test_whiten_over_masked_entries_only() -> None:
    # masked entries 1, 2, 3, 4: mean 2.5, population variance (2.25 + 0.25 + 0.25 + 2.25) / 4 = 1.25.
    scale = 1 / math.sqrt(1.25 + 1e-8)
    whitened = whiten(tensor([[1, 2, 3], [4, 100, 100]]), tensor([[1, 1, 1], [1, 0, 0]]))
    close(whitened, [[-1.5 * scale, -0.5 * scale, 0.5 * scale], [1.5 * scale, 0, 0]])


@pytest.mark.parametrize("value", [0.05, 0.1, 0.2, 0.7])
def test_whiten_equal_entries_give_exactly_zero(value: float) -> None:
    """Fifteen returns of 0.1 (of 0.05, 0.2, 0.7: values whose fp32 mean over fifteen is a rounding step
    off) beside padding that differs. Catches: dropping the equal-entries rule, which gives 3.7e-5 to 6e-4
    to every token, all of one sign; REINFORCE++ on a batch of equal rewards inherits it."""
    values = torch.cat([torch.full((7, 2), value), tensor([[value, 5.0]])])
    mask = torch.cat([torch.ones(7, 2), tensor([[1, 0]])])
    assert torch.equal(whiten(values, mask), torch.zeros(8, 2))
    assert torch.equal(reinforce_plus_plus(torch.full((8,), value), mask, 1.0), torch.zeros(8, 2))
    assert torch.equal(whiten(torch.zeros(2, 3), torch.zeros(2, 3)), torch.zeros(2, 3))  # no entry at all


def test_advantages_and_returns_without_whitening_is_gae_of_terminal_rewards() -> None:
    config = PPOConfig(gamma=GAMMA, lam=LAM, whiten_advantages=False)
    advantages, returns = advantages_and_returns(tensor([1.0, 2.0]), tensor(GAE_VALUES), tensor(GAE_MASK), config)
    close(advantages, GAE_ADVANTAGES)
    close(returns, GAE_RETURNS)


def test_advantages_and_returns_whitens_advantages_but_not_returns() -> None:
    config = PPOConfig(gamma=GAMMA, lam=LAM, whiten_advantages=True)
    advantages, returns = advantages_and_returns(tensor([1.0, 2.0]), tensor(GAE_VALUES), tensor(GAE_MASK), config)
    real = [A0_0, A0_1, A0_2, A1_0, A1_1]
    mean = sum(real) / len(real)
    scale = 1 / math.sqrt(sum((a - mean) ** 2 for a in real) / len(real) + 1e-8)
    close(advantages, [[(a - mean) * scale for a in real[:3]], [(A1_0 - mean) * scale, (A1_1 - mean) * scale, 0.0]])
    close(returns, GAE_RETURNS)


# Four real tokens and one padded; value_clip 0.2.
#   old  new  return   clipped new   (new-R)^2   (clipped-R)^2   max    clip raises the loss?
#   0.0  0.5  1.0      0.2           0.25        0.64            0.64   yes
#   0.0  0.1  1.0      0.1           0.81        0.81            0.81   no (inside the clip range)
#   1.0  0.5  0.0      0.8           0.25        0.64            0.64   yes
#   0.0  0.5  0.3      0.2           0.04        0.01            0.04   no (clipped, but the unclipped loss is larger)
VALUE_OLD = [[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]
VALUE_NEW = [[0.5, 0.1, 0.5], [0.5, 5.0, 0.0]]
VALUE_RETURNS = [[1.0, 1.0, 0.0], [0.3, -5.0, 0.0]]
VALUE_MASK = [[1, 1, 1], [1, 0, 0]]


def test_value_loss_when_clipping_engages() -> None:
    loss, stats = value_loss(tensor(VALUE_NEW), tensor(VALUE_OLD), tensor(VALUE_RETURNS), tensor(VALUE_MASK),
                             value_clip=0.2)
    assert loss.item() == pytest.approx(0.5 * (0.64 + 0.81 + 0.64 + 0.04) / 4)
    assert stats["vf_clipfrac"] == pytest.approx(2 / 4)


def test_value_loss_with_a_batch_normalizer() -> None:
    loss, _ = value_loss(tensor(VALUE_NEW), tensor(VALUE_OLD), tensor(VALUE_RETURNS), tensor(VALUE_MASK),
                         value_clip=0.2, normalizer=10.0)
    assert loss.item() == pytest.approx(0.5 * (0.64 + 0.81 + 0.64 + 0.04) / 10)


def test_value_loss_when_clipping_does_not_engage() -> None:
    # Every new value within 0.2 of the old one: the plain squared error, halved and averaged.
    loss, stats = value_loss(tensor([[0.1, -0.15]]), tensor([[0.0, 0.0]]), tensor([[1.0, 0.5]]), tensor([[1, 1]]),
                             value_clip=0.2)
    assert loss.item() == pytest.approx(0.5 * (0.9 ** 2 + 0.65 ** 2) / 2)
    assert stats["vf_clipfrac"] == 0.0


# --- policy loss ------------------------------------------------------------------------------------

AGG_VALUES = [[1, 2, 3], [4, 5, 6]]
AGG_MASK = [[1, 1, 0], [1, 1, 1]]


def test_aggregate_token_and_sequence() -> None:
    values, mask = tensor(AGG_VALUES), tensor(AGG_MASK)
    assert aggregate(values, mask, "token").item() == pytest.approx((1 + 2 + 4 + 5 + 6) / 5)
    assert aggregate(values, mask, "sequence").item() == pytest.approx(((1 + 2) / 2 + (4 + 5 + 6) / 3) / 2)


def test_aggregate_with_a_batch_normalizer() -> None:
    values, mask = tensor(AGG_VALUES), tensor(AGG_MASK)
    assert aggregate(values, mask, "token", normalizer=10).item() == pytest.approx(18 / 10)
    assert aggregate(values, mask, "sequence", normalizer=4).item() == pytest.approx((1.5 + 5) / 4)


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_micro_batch_losses_with_the_batch_normalizer_sum_to_the_batch_loss(aggregation: str) -> None:
    values = tensor([[1, 2, 3, 4], [5, 6, 7, 8], [-1, -2, -3, -4], [0.5, 9, 2, 3]])
    mask = tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]])
    # token: (10 + 5 - 3 + 11.5) / 10 tokens; sequence: (10/4 + 5/1 - 3/2 + 11.5/3) / 4 sequences.
    expected = 23.5 / 10 if aggregation == "token" else (2.5 + 5 - 1.5 + 11.5 / 3) / 4
    normalizer = 10.0 if aggregation == "token" else 4.0
    assert aggregate(values, mask, aggregation).item() == pytest.approx(expected)
    for split in ([1, 3], [2, 2], [1, 1, 1, 1]):
        parts = zip(values.split(split), mask.split(split))
        total = sum(aggregate(v, m, aggregation, normalizer=normalizer) for v, m in parts)
        assert total.item() == pytest.approx(expected)
    # Without the batch normalizer each micro-batch averages on its own, and the sum is something else.
    unnormalised = sum(aggregate(v, m, aggregation) for v, m in zip(values.split(2), mask.split(2)))
    assert unnormalised.item() != pytest.approx(expected)


def surrogate_case(ratio: float, advantage: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The surrogate for one token with the given probability ratio, DAPO's clip_low 0.2, clip_high 0.28."""
    return clipped_surrogate(tensor([math.log(ratio)]), tensor([0.0]), tensor([advantage]), 0.2, 0.28)


@pytest.mark.parametrize(("ratio", "advantage", "loss", "was_clipped"), [
    (1.5, 1.0, -1.28, 1.0),    # A > 0, ratio above 1 + 0.28: held at the ceiling
    (1.5, -1.0, 1.5, 0.0),     # A < 0, ratio above the ceiling: no clip (the unclipped term is the smaller)
    (0.5, 1.0, -0.5, 0.0),     # A > 0, ratio below the floor: no clip
    (0.5, -1.0, 0.8, 1.0),     # A < 0, ratio below 1 - 0.2: held at the floor
    (1.25, 2.0, -2.5, 0.0),    # inside the asymmetric range; a symmetric 0.2 would have clipped to -2.4
    (0.75, -2.0, 1.6, 1.0),    # below the 0.8 floor with A < 0: 0.8 * -2 = -1.6 < -1.5
    (1.0, 3.0, -3.0, 0.0),
    (2.0, 0.0, 0.0, 0.0),      # zero advantage: no loss and nothing counted as clipped
])
def test_clipped_surrogate_asymmetric_clip(ratio: float, advantage: float, loss: float, was_clipped: float) -> None:
    per_token, clipped = surrogate_case(ratio, advantage)
    close(per_token, [loss])
    close(clipped, [was_clipped])


def test_gspo_clips_the_geometric_mean_ratio_of_each_response() -> None:
    """Two responses (the second one token shorter): each token carries its response's ratio
    exp(mean log ratio); the gradient is that ratio times the mean token score."""
    old = tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, 0.0]])
    logprobs = (old + tensor([[0.3, 0.1, -0.1], [-0.6, 0.0, 0.0]])).requires_grad_(True)
    mask = tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    advantages = tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    per_token, clipped = clipped_surrogate(logprobs, old, advantages, 0.2, 0.05, mask, "sequence")
    first, second = math.exp(0.3 / 3), math.exp(-0.6 / 2)  # 1.105 (above 1.05), 0.741 (below 0.8)
    close(per_token[0], [-1.05] * 3)  # A > 0 above the ceiling: clipped, no gradient
    close(per_token[1, :2], [0.8] * 2)  # A < 0 below the floor: clipped
    close(clipped * mask, [[1.0] * 3, [1.0, 1.0, 0.0]])
    per_token, _ = clipped_surrogate(logprobs, old, advantages, 0.2, 0.28, mask, "sequence")
    close(per_token[0], [-first] * 3)  # inside a 0.28 ceiling: unclipped
    aggregate(per_token, mask, "sequence").backward()
    close(logprobs.grad[0], [-first / 3 / 2] * 3)  # d(-s)/dlogp_t = -s / |y|, over 2 sequences
    close(logprobs.grad[1], [0.0, 0.0, 0.0])  # the second is still clipped at the floor
    assert second < 0.8


def test_kl_k1_and_k3_values() -> None:
    logprobs = tensor([math.log(0.5), math.log(0.25), math.log(0.3)])
    ref_logprobs = tensor([math.log(0.25), math.log(0.5), math.log(0.3)])
    # k1 = log p - log p_ref; k3 = r - log r - 1 with r = p_ref / p.
    close(kl_divergence(logprobs, ref_logprobs, "k1"), [math.log(2), -math.log(2), 0.0])
    close(kl_divergence(logprobs, ref_logprobs, "k3"), [0.5 - math.log(0.5) - 1, 2 - math.log(2) - 1, 0.0])


def test_kl_k3_is_never_negative_and_zero_only_when_equal() -> None:
    generator = torch.Generator().manual_seed(0)
    logprobs = -5 * torch.rand(1000, generator=generator)
    ref_logprobs = -5 * torch.rand(1000, generator=generator)
    k3 = kl_divergence(logprobs, ref_logprobs, "k3")
    assert (k3 >= 0).all()
    assert (k3[(logprobs - ref_logprobs).abs() > 1e-2] > 0).all()
    close(kl_divergence(logprobs, logprobs, "k3"), [0.0] * 1000)
    # k1 does go negative, which is why k3 is the default.
    assert (kl_divergence(logprobs, ref_logprobs, "k1") < 0).any()


def test_kl_estimators_average_to_the_true_kl() -> None:
    # p = [1/2, 1/4, 1/4], p_ref = [1/4, 1/4, 1/2]: KL(p || p_ref) = 1/2 ln 2 + 0 + 1/4 ln(1/2) = 1/4 ln 2.
    p, p_ref = [0.5, 0.25, 0.25], [0.25, 0.25, 0.5]
    logprobs, ref_logprobs = tensor([math.log(x) for x in p]), tensor([math.log(x) for x in p_ref])
    for estimator in ("k1", "k3"):
        expectation = (tensor(p) * kl_divergence(logprobs, ref_logprobs, estimator)).sum()
        assert expectation.item() == pytest.approx(0.25 * math.log(2))


# Three real tokens and one padded, clip 0.2 both ways.
#   ratio  A    surrogate               k1 = lp - ref   entropy
#   1.5    1    -min(1.5, 1.2) = -1.2   -0.5+0.7 = 0.2  1.0   (clipped)
#   1.0    2    -2                      0               2.0
#   0.5   -1    -min(-0.5, -0.8) = 0.8  -2.0+1.5 = -0.5 0.5   (clipped)
#   2.0    5    (padding)               2.9             9.0
LOSS_RATIOS = [[1.5, 1.0], [0.5, 2.0]]
LOSS_LOGPROBS = [[-0.5, -1.0], [-2.0, -0.1]]
LOSS_OLD = [[lp - math.log(r) for lp, r in zip(lps, rs)] for lps, rs in zip(LOSS_LOGPROBS, LOSS_RATIOS)]
LOSS_ADVANTAGES = [[1.0, 2.0], [-1.0, 5.0]]
LOSS_MASK = [[1, 1], [1, 0]]
LOSS_REF = [[-0.7, -1.0], [-1.5, -3.0]]
LOSS_ENTROPY = [[1.0, 2.0], [0.5, 9.0]]


def full_policy_loss(config: PolicyLossConfig, rows: slice = slice(None),
                     **kwargs: object) -> tuple[torch.Tensor, dict]:
    return policy_loss(config, tensor(LOSS_LOGPROBS)[rows], tensor(LOSS_OLD)[rows], tensor(LOSS_ADVANTAGES)[rows],
                       tensor(LOSS_MASK)[rows], entropy=tensor(LOSS_ENTROPY)[rows], ref_logprobs=tensor(LOSS_REF)[rows],
                       **kwargs)


def test_policy_loss_surrogate_only() -> None:
    loss, stats = full_policy_loss(PolicyLossConfig())
    assert loss.item() == pytest.approx((-1.2 - 2 + 0.8) / 3)
    assert stats == {"pg_clipfrac": pytest.approx(2 / 3)}  # no "kl" without kl_loss_coef


def test_policy_loss_with_k1_kl_and_entropy_terms() -> None:
    config = PolicyLossConfig(kl_loss_coef=0.1, kl_estimator="k1", entropy_coef=0.01)
    per_token = [-1.2 + 0.1 * 0.2 - 0.01 * 1.0, -2.0 + 0.1 * 0.0 - 0.01 * 2.0, 0.8 + 0.1 * -0.5 - 0.01 * 0.5]
    loss, stats = full_policy_loss(config)
    assert loss.item() == pytest.approx(sum(per_token) / 3)  # -0.821667
    assert stats["kl"] == pytest.approx((0.2 + 0.0 - 0.5) / 3)
    assert stats["pg_clipfrac"] == pytest.approx(2 / 3)


def test_policy_loss_with_k3_kl_and_sequence_aggregation() -> None:
    config = PolicyLossConfig(kl_loss_coef=0.1, kl_estimator="k3", entropy_coef=0.01, loss_aggregation="sequence")
    # k3 from log r = ref - lp: -0.2, 0, 0.5.
    k3 = [math.exp(-0.2) + 0.2 - 1, 0.0, math.exp(0.5) - 0.5 - 1]
    per_token = [-1.2 + 0.1 * k3[0] - 0.01 * 1.0, -2.0 + 0.1 * k3[1] - 0.01 * 2.0, 0.8 + 0.1 * k3[2] - 0.01 * 0.5]
    loss, stats = full_policy_loss(config)
    assert loss.item() == pytest.approx(((per_token[0] + per_token[1]) / 2 + per_token[2]) / 2)
    assert stats["kl"] == pytest.approx(sum(k3) / 3)


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_policy_loss_micro_batches_with_the_batch_normalizer_sum_to_the_batch_loss(aggregation: str) -> None:
    config = PolicyLossConfig(kl_loss_coef=0.1, entropy_coef=0.01, loss_aggregation=aggregation)
    normalizer = 3.0 if aggregation == "token" else 2.0
    whole, _ = full_policy_loss(config)
    first, _ = full_policy_loss(config, slice(0, 1), normalizer=normalizer)
    second, _ = full_policy_loss(config, slice(1, 2), normalizer=normalizer)
    assert (first + second).item() == pytest.approx(whole.item())


def test_policy_loss_needs_ref_logprobs_for_kl() -> None:
    config = PolicyLossConfig(kl_loss_coef=0.1)
    with pytest.raises(ValueError, match="reference model's log-probs"):
        policy_loss(config, tensor(LOSS_LOGPROBS), tensor(LOSS_OLD), tensor(LOSS_ADVANTAGES), tensor(LOSS_MASK))


def test_policy_loss_needs_entropy_for_the_entropy_bonus() -> None:
    config = PolicyLossConfig(entropy_coef=0.01)
    with pytest.raises(ValueError, match="per-token entropy"):
        policy_loss(config, tensor(LOSS_LOGPROBS), tensor(LOSS_OLD), tensor(LOSS_ADVANTAGES), tensor(LOSS_MASK))


def test_policy_loss_without_coefficients_needs_neither() -> None:
    loss, _ = policy_loss(PolicyLossConfig(), tensor(LOSS_LOGPROBS), tensor(LOSS_OLD), tensor(LOSS_ADVANTAGES),
                          tensor(LOSS_MASK))
    assert loss.item() == pytest.approx((-1.2 - 2 + 0.8) / 3)


# Behaviour log-probs such that pi_old / pi_behaviour is 0.5, 1.0, 3.0 on the real tokens (4.0 on padding).
LOSS_WEIGHTS = [[0.5, 1.0], [3.0, 4.0]]
LOSS_BEHAVIOUR = [[old - math.log(w) for old, w in zip(olds, ws)] for olds, ws in zip(LOSS_OLD, LOSS_WEIGHTS)]


def test_importance_weights_tis_truncates_and_decoupled_drops_above_the_cap() -> None:
    old, behaviour, everywhere = tensor(LOSS_OLD), tensor(LOSS_BEHAVIOUR), torch.ones(2, 2)
    weights, over = importance_weights(old, behaviour, everywhere, "tis", cap=2.0)
    close(weights, [[0.5, 1.0], [2.0, 2.0]])
    close(over, [[0.0, 0.0], [1.0, 1.0]])
    weights, over = importance_weights(old, behaviour, everywhere, "decoupled", cap=2.0)
    close(weights, [[0.5, 1.0], [0.0, 0.0]])
    close(over, [[0.0, 0.0], [1.0, 1.0]])


@pytest.mark.parametrize(("correction", "weights", "tis", "changed"), [
    ("tis", [0.5, 1.0, 2.0], (0.5 + 1.0 + 2.0) / 3, "tis_clipfrac"),
    ("decoupled", [0.5, 1.0, 0.0], (0.5 + 1.0) / 3, "tis_maskfrac"),
    ("icepop", [0.5, 1.0, 0.0], (0.5 + 1.0) / 3, "tis_maskfrac"),
])
def test_policy_loss_with_an_off_policy_correction(correction: str, weights: list[float], tis: float,
                                                   changed: str) -> None:
    config = PolicyLossConfig(off_policy_correction=correction, tis_cap=2.0)
    loss, stats = full_policy_loss(config, behaviour_logprobs=tensor(LOSS_BEHAVIOUR))
    surrogate = [-1.2, -2.0, 0.8]  # the clip stays around pi_old (the proximal policy)
    assert loss.item() == pytest.approx(sum(s * w for s, w in zip(surrogate, weights)) / 3)
    assert stats["tis"] == pytest.approx(tis)
    assert stats[changed] == pytest.approx(1 / 3)  # padding does not count
    assert stats["pg_clipfrac"] == pytest.approx(2 / 3)


def test_policy_loss_correction_on_policy_changes_nothing() -> None:
    plain, _ = full_policy_loss(PolicyLossConfig())
    for correction, changed in (("tis", "tis_clipfrac"), ("decoupled", "tis_maskfrac"), ("icepop", "tis_maskfrac")):
        corrected, stats = full_policy_loss(PolicyLossConfig(off_policy_correction=correction),
                                            behaviour_logprobs=tensor(LOSS_OLD))
        assert corrected.item() == pytest.approx(plain.item())
        assert stats["tis"] == pytest.approx(1.0) and stats[changed] == 0.0


def test_stale_tokens_take_their_ratio_against_the_log_probs_they_were_sampled_with() -> None:
    old, behaviour = tensor([[-1.0, -2.0, -3.0]]), tensor([[-1.5, -2.5, -3.5]])
    stale = torch.tensor([[True, False, True]])
    assert_close(ratio_anchor(PolicyLossConfig(), old, behaviour, stale), tensor([[-1.5, -2.0, -3.5]]))
    for config in (PolicyLossConfig(stale_ratio="proximal"), PolicyLossConfig(off_policy_correction="tis"),
                   PolicyLossConfig(ratio_level="sequence")):  # GSPO: not per token inside its ~1e-4 clip
        assert_close(ratio_anchor(config, old, behaviour, stale), old)


@pytest.mark.parametrize("backend, top_p, top_k, anchored", [
    ("vllm", 1.0, 0, "behaviour"), ("vllm", 0.9, 0, "proximal"), ("vllm", 1.0, 20, "proximal"),
    ("torch", 0.9, 0, "behaviour")])
def test_vllms_truncated_log_probs_are_no_anchor(backend, top_p, top_k, anchored) -> None:
    """vLLM reports top-p/top-k log-probs of the renormalised, truncated distribution: a stale token's ratio
    against them is off by the mass cut off, so the trainer takes its ratio against its own (the reference
    engine reports the untruncated distribution and keeps the anchor)."""
    from vime.config import RunConfig

    run = RunConfig().replace(rollout_backend=backend, top_p=top_p, top_k=top_k, model_path="m")
    assert run.train_engine_arguments(seed=0)["loss"].stale_ratio == anchored


def test_policy_loss_correction_needs_the_rollout_logprobs() -> None:
    with pytest.raises(ValueError, match="needs the rollout log-probs"):
        full_policy_loss(PolicyLossConfig(off_policy_correction="tis"))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"loss_aggregation": "mean"}, "--loss-aggregation must be one of token, sequence, seq-mean-token-sum, "
                                   "seq-mean-token-sum-norm, not 'mean'"),
    ({"kl_estimator": "k4"}, r"--kl-estimator \(or --kl-loss-type\) must be one of k1, k2, k3, low_var_kl, not 'k4'"),
    ({"policy_loss": "ppo2"}, "--policy-loss must be one of ppo, cispo"),
    ({"tis_level": "group"}, "--tis-level must be one of token, sequence-geometric, sequence-product"),
    ({"dual_clip_c": 1.0}, "--dual-clip-c must be > 1"),
    ({"dual_clip_c": 3.0, "policy_loss": "cispo"}, "--dual-clip-c applies to --policy-loss ppo"),
    ({"policy_loss": "cispo", "ratio_level": "sequence"}, "cispo weighs each token by its own ratio"),
    ({"tis_floor": 1.5}, "--tis-floor must be in"),
    ({"off_policy_correction": "decoupled", "tis_level": "sequence-product"}, "decoupled is token-level"),
    ({"kl_coef": -0.1}, "must be >= 0"),
    ({"clip_low": 1.0}, "clip_low must be in"),
    ({"clip_low": -0.1}, "clip_low must be in"),
    ({"clip_high": -0.1}, "clip_high >= 0"),
    ({"off_policy_correction": "is"}, "--off-policy-correction must be one of none, tis, icepop, decoupled, not 'is'"),
    ({"tis_cap": 0.5}, "tis_cap must be >= 1"),
])
def test_policy_loss_config_rejects_bad_settings(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PolicyLossConfig(**kwargs)


def test_policy_loss_config_accepts_edge_settings() -> None:
    config = PolicyLossConfig(clip_low=0.0, clip_high=0.0, loss_aggregation="sequence", kl_estimator="k1")
    assert (config.clip_low, config.clip_high) == (0.0, 0.0)


# --- dynamic sampling -------------------------------------------------------------------------------


@pytest.mark.parametrize(("rewards", "informative"), [
    ([], False),
    ([1.0], False),
    ([1.0, 1.0, 1.0], False),
    ([0.0, 1.0], True),
    ([1.0, 0.0, 1.0], True),
    ([1.0, 1.0 + 1e-12], False),  # within the default tolerance
])
def test_is_informative(rewards: list[float], informative: bool) -> None:
    assert is_informative(rewards) is informative


def test_is_informative_tolerance() -> None:
    assert not is_informative([0.0, 0.4], tolerance=0.5)
    assert is_informative([0.0, 0.6], tolerance=0.5)


# --- issue 31: estimators, losses, KL, aggregation, corrections --------------------------------------
#
# Each test's docstring names the deliberate bug it was seen to catch (the mutation check): the bug was
# put into the code, the test failed, the bug was taken out.

def random_groups(seed: int, sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards in {0, 0.5, 1} (ties are common, whole groups often equal) for groups of ``sizes``, ids
    shuffled through the batch."""
    generator = torch.Generator().manual_seed(seed)
    group_ids = torch.cat([torch.full((size,), 100 + index) for index, size in enumerate(sizes)])
    group_ids = group_ids[torch.randperm(len(group_ids), generator=generator)]
    rewards = torch.randint(0, 3, (len(group_ids),), generator=generator).float() / 2
    return rewards, group_ids


def members_of(rewards: torch.Tensor, group_ids: torch.Tensor, row: int) -> list[float]:
    return [float(r) for r, g in zip(rewards, group_ids) if g == group_ids[row]]


def test_an_equal_reward_group_gets_exactly_zero_advantage() -> None:
    """Item 6: eight samples of partial credit 0.1 used to get -0.0074 each (the fp32 mean one rounding
    step off, divided by std + 1e-6). Catches: dropping the equal-group rule (the old flaw comes back)."""
    rewards = torch.cat([torch.full((8,), 0.1), tensor([0.0, 1.0])])
    group_ids = torch.tensor([0] * 8 + [1, 1])
    advantages = group_advantages(rewards, group_ids, GRPOConfig())
    assert torch.equal(advantages[:8], torch.zeros(8))
    assert advantages[9].item() == pytest.approx(0.5 / (math.sqrt(0.5) + EPS))


@pytest.mark.parametrize("seed", range(5))
def test_group_advantages_follow_the_formula_on_random_groups(seed: int) -> None:
    """Groups of one to five in any order against ``(r - mean) / (unbiased std + eps)`` in float64.
    Catches: the biased std (dividing by n instead of n - 1)."""
    rewards, group_ids = random_groups(seed, [1, 2, 3, 5, 4, 1])
    advantages = group_advantages(rewards, group_ids, GRPOConfig())
    for row in range(len(rewards)):
        group = members_of(rewards, group_ids, row)
        mean = sum(group) / len(group)
        if max(group) == min(group):
            assert advantages[row].item() == 0.0
            continue
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (len(group) - 1))
        assert advantages[row].item() == pytest.approx((float(rewards[row]) - mean) / (std + EPS), rel=1e-5)


def test_rloo_subtracts_the_mean_of_the_rest_of_the_group() -> None:
    """Group [1, 0, 0, 1]: 1 - (0 + 0 + 1) / 3 = 2/3 and 0 - 2/3; group [3, 5]: -2, 2; a group of one: 0.
    Catches: the plain group mean as the baseline (a factor n / (n - 1) short: 1/2 instead of 2/3)."""
    advantages = rloo_advantages(tensor([1, 3, 0, 9, 0, 5, 1]), torch.tensor([0, 1, 0, 2, 0, 1, 0]))
    close(advantages, [2 / 3, -2, -2 / 3, 0, -2 / 3, 2, 2 / 3])


@pytest.mark.parametrize("seed", range(5))
def test_rloo_follows_the_leave_one_out_definition_on_random_groups(seed: int) -> None:
    """Against ``r_i - sum_{j != i} r_j / (n - 1)`` summed explicitly, groups of one giving 0 and equal
    groups exactly 0. Catches: dividing by n instead of n - 1 in the leave-one-out mean."""
    rewards, group_ids = random_groups(seed, [1, 2, 3, 8, 1, 4])
    advantages = rloo_advantages(rewards, group_ids)
    for row in range(len(rewards)):
        group = members_of(rewards, group_ids, row)
        if len(group) == 1 or max(group) == min(group):
            assert advantages[row].item() == 0.0
            continue
        others = (sum(group) - float(rewards[row])) / (len(group) - 1)
        assert advantages[row].item() == pytest.approx(float(rewards[row]) - others, abs=1e-6)


def whitened(values: list[float]) -> list[float]:
    """Mean 0, population std 1 (eps 1e-8 on the variance), as ``ppo.whiten``."""
    mean = sum(values) / len(values)
    scale = 1 / math.sqrt(sum((v - mean) ** 2 for v in values) / len(values) + 1e-8)
    return [(v - mean) * scale for v in values]


def test_reinforce_plus_plus_hand_computed() -> None:
    """Sample 0: three tokens, reward 1, KL penalties 0.1, 0.2, 0.3; sample 1: one token, reward 0,
    penalty 0.4 (its padding's 5.0 unused); gamma 0.5. Token rewards -0.1, -0.2, 0.7 and -0.4; returns
    G_2 = 0.7, G_1 = -0.2 + 0.35 = 0.15, G_0 = -0.1 + 0.075 = -0.025, and -0.4; then whitened.
    Catches: the penalty added instead of subtracted; gamma ignored."""
    mask = tensor([[1, 1, 1], [1, 0, 0]])
    penalty = tensor([[0.1, 0.2, 0.3], [0.4, 5.0, 5.0]])
    advantages = reinforce_plus_plus(tensor([1.0, 0.0]), mask, 0.5, penalty)
    a = whitened([-0.025, 0.15, 0.7, -0.4])
    close(advantages, [a[:3], [a[3], 0, 0]])


def reinforce_by_hand(rewards: list[float], mask: list[list[float]], penalty: list[list[float]],
                      gamma: float) -> list[list[float]]:
    """Discounted returns of KL-penalised token rewards, walking only real tokens, whitened over them."""
    returns = []
    for reward, keep, kl in zip(rewards, mask, penalty):
        real = [t for t, m in enumerate(keep) if m]
        row, running = [0.0] * len(keep), 0.0
        for position, t in enumerate(reversed(real)):
            running = -kl[t] + (reward if position == 0 else 0.0) + gamma * running
            row[t] = running
        returns.append(row)
    flat = whitened([v for row, keep in zip(returns, mask) for v, m in zip(row, keep) if m] or [0.0])
    values = iter(flat)
    return [[next(values) if m else 0.0 for m in keep] for keep in mask]


@pytest.mark.parametrize("seed", range(4))
def test_reinforce_plus_plus_follows_the_formula_with_holes_empty_rows_and_single_tokens(seed: int) -> None:
    """Random rewards and penalties over masks with tool-message holes, an empty row and one-token rows.
    Catches: padding or holes counted as steps (the discount applied across them)."""
    generator = torch.Generator().manual_seed(seed)
    mask = tensor([[1, 1, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0], [1, 0, 1, 1, 1, 0]])
    rewards = torch.randn(4, generator=generator)
    penalty = torch.rand(4, 6, generator=generator)
    advantages = reinforce_plus_plus(rewards, mask, 0.9, penalty)
    close(advantages, reinforce_by_hand(rewards.tolist(), mask.tolist(), penalty.tolist(), 0.9))


def test_reinforce_plus_plus_baseline_centres_each_group_without_its_std() -> None:
    """Groups [2, 0] and [0.5, 0] (ids 4, 9), one token each, gamma 1, no KL: centred 1, -1, 0.25, -0.25,
    then whitened over the batch. Catches: dividing by the group std too (GRPO's default), which would make
    both groups +-0.707 and lose the second group's smaller spread."""
    mask = tensor([[1], [1], [1], [1]])
    advantages = reinforce_plus_plus_baseline(tensor([2.0, 0.5, 0.0, 0.0]), torch.tensor([4, 9, 4, 9]), mask, 1.0)
    a = whitened([1.0, 0.25, -1.0, -0.25])
    close(advantages, [[value] for value in a])


def test_ppo_folds_the_kl_penalty_into_the_token_rewards() -> None:
    """gamma = lam = 1, values 0, no whitening: the advantages are returns-to-go of 1 on the last token
    less penalties 0.1, 0.2, 0.3: 0.4, 0.5, 0.7 (the padded token's penalty 9 unused). Catches: the penalty
    left out of PPO's rewards."""
    config = PPOConfig(gamma=1.0, lam=1.0, whiten_advantages=False)
    mask = tensor([[1, 1, 1, 0]])
    advantages, returns = advantages_and_returns(tensor([1.0]), torch.zeros(1, 4), mask, config,
                                                 kl_penalty=tensor([[0.1, 0.2, 0.3, 9.0]]))
    close(advantages, [[0.4, 0.5, 0.7, 0.0]])
    close(returns, [[0.4, 0.5, 0.7, 0.0]])


def test_estimators_dispatch_and_refuse_the_reward_kl_where_there_is_no_reward_to_fold_it_into() -> None:
    """One call per estimator on the same batch; --kl-coef with grpo names --kl-loss-coef. Catches: the
    check removed (the old meaning of --kl-coef silently ignored under grpo)."""
    rewards, group_ids, mask = tensor([1.0, 0.0, 3.0]), torch.tensor([0, 0, 1]), tensor([[1, 1], [1, 0], [1, 1]])
    settings = dict(grpo_config=GRPOConfig(normalize_std=False), ppo_config=PPOConfig(gamma=1.0))
    grpo_like, _ = estimator_advantages("grpo", rewards, group_ids, mask, **settings)
    close(grpo_like, [[0.5, 0.5], [-0.5, 0], [0, 0]])
    leave_one_out, _ = estimator_advantages("rloo", rewards, group_ids, mask, **settings)
    close(leave_one_out, [[1, 1], [-1, 0], [0, 0]])
    a = whitened([1.0, 1.0, 0.0, 3.0, 3.0])
    reinforce, _ = estimator_advantages("reinforce_plus_plus", rewards, group_ids, mask, **settings)
    close(reinforce, [a[:2], [a[2], 0], a[3:]])
    with pytest.raises(ValueError, match="ppo's advantages need the value model's values"):
        estimator_advantages("ppo", rewards, group_ids, mask, **settings)
    for estimator in ("grpo", "gspo", "rloo"):
        with pytest.raises(ValueError, match="--kl-coef is the KL penalty folded into the reward.*--kl-loss-coef"):
            check_estimator(estimator, PolicyLossConfig(kl_coef=0.1))
    for estimator in REWARD_KL_ESTIMATORS:
        check_estimator(estimator, PolicyLossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="must be one of grpo, gspo, rloo"):
        check_estimator("dpo", PolicyLossConfig())
    assert loss_settings("gspo", PolicyLossConfig()).ratio_level == "sequence"
    assert loss_settings("grpo", PolicyLossConfig()).ratio_level == "token"


def test_kl_k2_and_low_var_kl_values() -> None:
    """log r = ref - lp of -0.5, 0.3, 30, -30: k2 = (log r)^2 / 2; low_var_kl is k3 (r - 1 - log r) where
    small, and 10 for both far-off tokens (log r clamped to +-20, then k3 to 10). Catches: low_var_kl
    without its clamps (e^30 - 31 and 29); k2 without the half."""
    logprobs = tensor([-1.0, -2.0, -40.0, -1.0])
    ref = tensor([-1.5, -1.7, -10.0, -31.0])
    close(kl_divergence(logprobs, ref, "k2"), [0.125, 0.045, 450.0, 450.0])
    small = [math.exp(-0.5) - 1 + 0.5, math.exp(0.3) - 1 - 0.3]
    close(kl_divergence(logprobs, ref, "low_var_kl"), [*small, 10.0, 10.0])
    close(kl_divergence(logprobs[:2], ref[:2], "k3"), small)


def test_low_var_kl_equals_k3_inside_its_clamps_and_k2_is_half_k1_squared() -> None:
    """On random log-probs within 2 nats of each other (k3 stays under 10). Catches: low_var_kl clamping log r to a
    narrower
    range than [-20, 20] (slime and verl's)."""
    generator = torch.Generator().manual_seed(1)
    logprobs = -5 * torch.rand(500, generator=generator)
    ref = logprobs + 4 * torch.rand(500, generator=generator) - 2
    close(kl_divergence(logprobs, ref, "low_var_kl"), kl_divergence(logprobs, ref, "k3").tolist())
    close(kl_divergence(logprobs, ref, "k2"), (0.5 * kl_divergence(logprobs, ref, "k1") ** 2).tolist())


@pytest.mark.parametrize(("ratio", "advantage", "loss", "lower"), [
    (5.0, -1.0, 3.0, 1.0),     # A < 0, ratio far above: -min(-5, -1.2) = 5, bounded by -c A = 3
    (2.0, -1.0, 2.0, 0.0),     # A < 0, loss 2 under the bound 3: unchanged
    (5.0, 1.0, -1.2, 0.0),     # A > 0: the ordinary clip only
    (0.5, -2.0, 1.6, 0.0),     # A < 0 below the floor: held at the floor (0.8 x 2), under 6
])
def test_dual_clip_bounds_the_loss_of_negative_advantages(ratio: float, advantage: float, loss: float,
                                                          lower: float) -> None:
    """Clip 0.2 both ways, c = 3. Catches: the bound applied to positive advantages too (-c A = -3 would
    hold the A > 0 case)."""
    logprobs = tensor([math.log(ratio)]).requires_grad_(True)
    config = PolicyLossConfig(dual_clip_c=3.0)
    total, stats = policy_loss(config, logprobs, tensor([0.0]), tensor([advantage]), tensor([1.0]))
    assert total.item() == pytest.approx(loss)
    assert stats["pg_clipfrac_lower"].item() == lower
    total.backward()
    if lower:
        assert logprobs.grad.item() == 0.0  # the bound is a constant: no gradient through it


@pytest.mark.parametrize("seed", range(3))
def test_dual_clip_follows_verls_formula_on_extreme_ratios(seed: int) -> None:
    """Against ``where(A < 0, min(max(-rA, -clip(r)A), -cA), max(-rA, -clip(r)A))`` with log-ratios up to
    +-20. Catches: max instead of min against the bound."""
    generator = torch.Generator().manual_seed(seed)
    log_ratio = 40 * torch.rand(4, 16, generator=generator) - 20
    advantages = torch.randn(4, 16, generator=generator)
    ratio = log_ratio.exp()
    surrogate = torch.maximum(-ratio * advantages, -ratio.clamp(0.8, 1.28) * advantages)
    expected = torch.where(advantages < 0, torch.minimum(surrogate, -3.0 * advantages), surrogate)
    per_token, _ = clipped_surrogate(log_ratio, torch.zeros(4, 16), advantages, 0.2, 0.28)
    bounded, _ = dual_clip(per_token, advantages, 3.0)
    assert_close(bounded, expected)


@pytest.mark.parametrize(("ratio", "advantage", "value", "gradient", "clipped"), [
    (1.5, 1.0, -1.28, -1.28, 1.0),   # above 1 + 0.28: weight 1.28, and still a gradient (PPO's would be 0)
    (0.5, -1.0, 0.8, 0.8, 1.0),      # below 1 - 0.2: weight 0.8
    (1.1, 2.0, -2.2, -2.2, 0.0),     # inside: weight 1.1; d/dlogp of -sg(w) A log pi is -w A
])
def test_cispo_weighs_log_pi_by_the_clipped_detached_ratio(ratio: float, advantage: float, value: float,
                                                          gradient: float, clipped: float) -> None:
    """Catches: the weight not detached (the inside case's gradient doubles to -4.4), and the weight not
    clipped (the first case's would be -1.5)."""
    logprobs = tensor([math.log(ratio)]).requires_grad_(True)
    config = PolicyLossConfig(policy_loss="cispo", clip_low=0.2, clip_high=0.28)
    total, stats = policy_loss(config, logprobs, tensor([0.0]), tensor([advantage]), tensor([1.0]))
    total.backward()
    assert total.item() == pytest.approx(value)
    assert logprobs.grad.item() == pytest.approx(gradient)
    assert stats["pg_clipfrac"].item() == clipped


def test_cispo_gradient_on_random_tokens_is_the_clipped_weight_times_the_advantage() -> None:
    """Log-ratios up to +-20, a mask with an empty row and a one-token row, token aggregation. Catches: the
    mask left out of the sum (padding's gradient nonzero)."""
    generator = torch.Generator().manual_seed(3)
    old = -3 * torch.rand(3, 5, generator=generator)
    logprobs = (old + 40 * torch.rand(3, 5, generator=generator) - 20).requires_grad_(True)
    advantages = torch.randn(3, 5, generator=generator)
    mask = tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]])
    config = PolicyLossConfig(policy_loss="cispo", clip_low=0.5, clip_high=4.0)
    policy_loss(config, logprobs, old, advantages, mask)[0].backward()
    weight = (logprobs.detach() - old).exp().clamp(0.5, 5.0)
    assert_close(logprobs.grad, -weight * advantages * mask / 4)


def test_aggregations_sum_per_sequence_and_dr_grpos_constant() -> None:
    """[[1, 2, (3)], [4, 5, 6]]: seq-mean-token-sum (3 + 15) / 2 = 9; seq-mean-token-sum-norm 18 / (2 x 3)
    with the mask's width, 18 / (2 x 10) with a constant of 10. An empty third row counts as a response.
    Catches: seq-mean-token-sum dividing each sum by its length (that is "sequence", 3.25)."""
    values, mask = tensor(AGG_VALUES), tensor(AGG_MASK)
    assert aggregate(values, mask, "seq-mean-token-sum").item() == pytest.approx(9.0)
    assert aggregate(values, mask, "seq-mean-token-sum-norm").item() == pytest.approx(3.0)
    with_empty, empty_mask = tensor(AGG_VALUES + [[7, 8, 9]]), tensor(AGG_MASK + [[0, 0, 0]])
    assert aggregate(with_empty, empty_mask, "seq-mean-token-sum").item() == pytest.approx(18 / 3)
    assert aggregate(with_empty, empty_mask, "sequence").item() == pytest.approx((1.5 + 5) / 3)
    loss, _ = policy_loss(PolicyLossConfig(loss_aggregation="seq-mean-token-sum-norm", loss_scale_tokens=10),
                          tensor(LOSS_LOGPROBS), tensor(LOSS_OLD), tensor(LOSS_ADVANTAGES), tensor(LOSS_MASK))
    assert loss.item() == pytest.approx((-1.2 - 2 + 0.8) / (2 * 10))


@pytest.mark.parametrize("aggregation", ["seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_new_aggregations_add_up_over_micro_batches(aggregation: str) -> None:
    """The batch normaliser for 4 responses of 10 tokens (constant 6) makes micro-batch losses sum to the
    batch's. Catches: a micro-batch using its own response count."""
    values = tensor([[1, 2, 3, 4], [5, 6, 7, 8], [-1, -2, -3, -4], [0.5, 9, 2, 3]])
    mask = tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]])
    normalizer = batch_normalizer(aggregation, 4, 10.0, 6)
    expected = 23.5 / (4 if aggregation == "seq-mean-token-sum" else 24)
    for split in ([1, 3], [2, 2], [1, 1, 1, 1]):
        parts = zip(values.split(split), mask.split(split))
        assert sum(aggregate(v, m, aggregation, normalizer) for v, m in parts).item() == pytest.approx(expected)


def test_sequence_level_weights_and_icepop_by_hand() -> None:
    """Token weights [0.5, 1.0] and [3.0, (4.0 padding)]: geometric means sqrt(0.5) and 3, products 0.5
    and 3. tis [0.8, 2] raises the first response and truncates the second; icepop [0.6, 2] drops
    token 0.5 and token 3. Catches: padding counted in the sequence product (3 x 4 = 12) and icepop
    ignoring its floor."""
    old, behaviour, mask = tensor(LOSS_OLD), tensor(LOSS_BEHAVIOUR), tensor(LOSS_MASK)
    weights, changed = importance_weights(old, behaviour, mask, "tis", cap=10.0, level="sequence-geometric")
    close(weights, [[math.sqrt(0.5)] * 2, [3.0, 3.0]])
    weights, changed = importance_weights(old, behaviour, mask, "tis", cap=10.0, level="sequence-product")
    close(weights, [[0.5, 0.5], [3.0, 3.0]])
    assert not changed.any()
    weights, changed = importance_weights(old, behaviour, mask, "tis", cap=2.0, floor=0.8, level="sequence-geometric")
    close(weights, [[0.8, 0.8], [2.0, 2.0]])
    close(changed, [[1, 1], [1, 1]])
    weights, changed = importance_weights(old, behaviour, mask, "icepop", cap=2.0, floor=0.6)
    close(weights, [[0.0, 1.0], [0.0, 1.0]])  # padding: weight 1, changed by nothing (it adds nothing anyway)
    close(changed, [[1, 0], [1, 0]])
    loss, stats = full_policy_loss(PolicyLossConfig(off_policy_correction="icepop", tis_cap=2.0, tis_floor=0.6),
                                   behaviour_logprobs=tensor(LOSS_BEHAVIOUR))
    assert loss.item() == pytest.approx(-2.0 / 3)  # only the middle token (surrogate -2, weight 1) is left
    assert stats["tis_maskfrac"] == pytest.approx(2 / 3)


@pytest.mark.parametrize(("correction", "level"), [("tis", "token"), ("tis", "sequence-geometric"),
                                                   ("tis", "sequence-product"), ("icepop", "token"),
                                                   ("icepop", "sequence-geometric"), ("icepop", "sequence-product")])
def test_importance_weights_follow_the_formula_on_extreme_ratios(correction: str, level: str) -> None:
    """Log-weights up to +-50 per token (products far beyond float range) over rows with holes, an empty
    row and a one-token row, against float64 sums. Catches: the geometric mean divided by the row's width
    instead of its real tokens."""
    generator = torch.Generator().manual_seed(7)
    behaviour = -5 * torch.rand(4, 6, generator=generator)
    old = behaviour + 100 * torch.rand(4, 6, generator=generator) - 50
    old[0] = behaviour[0] + 0.3 * torch.randn(6, generator=generator)  # near on-policy: inside the bounds
    mask = tensor([[1, 1, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    weights, changed = importance_weights(old, behaviour, mask, correction, cap=2.0, floor=0.5, level=level)
    log_w = (old - behaviour).double() * mask
    if level != "token":
        total = log_w.sum(-1, keepdim=True)
        log_w = (total / mask.sum(-1, keepdim=True).clamp(min=1) if level == "sequence-geometric"
                 else total).expand_as(log_w)
    raw = log_w.exp()
    inside = (raw >= 0.5) & (raw <= 2.0)
    expected = raw.clamp(0.5, 2.0) if correction == "tis" else torch.where(inside, raw, 0.0)
    assert_close(weights.double(), expected, rtol=1e-4, atol=1e-6)
    assert torch.equal(changed.bool(), ~inside)
