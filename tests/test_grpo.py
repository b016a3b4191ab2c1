"""GRPO math on hand-computed cases."""

import math

import pytest
import torch

from rlsys.algorithms.grpo import (
    clipped_policy_loss,
    group_advantages,
    kl_estimate,
    masked_sum,
    token_entropy,
)


def test_zero_variance_groups_get_zero_advantage():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    assert torch.equal(group_advantages(rewards, group_size=3), torch.zeros(6))


def test_group_advantages_match_hand_computation():
    # group [1, 0, 0, 0]: mean 0.25, unbiased std sqrt(0.25) = 0.5
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), group_size=4, eps=0.0)
    assert torch.allclose(adv, torch.tensor([1.5, -0.5, -0.5, -0.5]))
    # groups are normalised separately
    adv = group_advantages(torch.tensor([2.0, 0.0, 5.0, 5.0]), group_size=2)
    assert torch.allclose(adv, torch.tensor([1 / math.sqrt(2), -1 / math.sqrt(2), 0.0, 0.0]), atol=1e-5)


def test_advantages_without_std_normalisation_are_centred_rewards():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), group_size=4, normalize_by_std=False)
    assert torch.allclose(adv, torch.tensor([0.75, -0.25, -0.25, -0.25]))


def test_rewards_that_do_not_fill_groups_are_rejected():
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.zeros(6), group_size=4)


def test_ratio_one_gives_minus_advantage_and_no_clipping():
    logp = torch.log(torch.tensor([[0.5, 0.25]]))
    terms = clipped_policy_loss(logp, logp.clone(), torch.tensor([[2.0]]), 0.2, 0.2)
    assert torch.allclose(terms.loss, torch.tensor([[-2.0, -2.0]]))
    assert terms.clipped.sum() == 0


def test_positive_advantage_is_clipped_above_one_plus_eps():
    old = torch.zeros(1, 2)
    new = torch.log(torch.tensor([[1.5, 1.1]]))  # ratios 1.5 (clipped at 1.2) and 1.1 (not)
    terms = clipped_policy_loss(new, old, torch.tensor([[1.0]]), 0.2, 0.2)
    assert torch.allclose(terms.loss, torch.tensor([[-1.2, -1.1]]))
    assert terms.clipped.tolist() == [[1.0, 0.0]]


def test_negative_advantage_is_clipped_below_one_minus_eps():
    old = torch.zeros(1, 2)
    new = torch.log(torch.tensor([[0.5, 1.5]]))  # A<0: ratio 0.5 clipped to 0.8; 1.5 kept (pessimistic)
    terms = clipped_policy_loss(new, old, torch.tensor([[-1.0]]), 0.2, 0.2)
    assert torch.allclose(terms.loss, torch.tensor([[0.8, 1.5]]))
    assert terms.clipped.tolist() == [[1.0, 0.0]]


def test_clipped_tokens_carry_no_gradient():
    old = torch.zeros(1, 1)
    new = torch.log(torch.tensor([[1.5]])).requires_grad_()
    clipped_policy_loss(new, old, torch.tensor([[1.0]]), 0.2, 0.2).loss.sum().backward()
    assert new.grad.item() == 0.0


def test_masked_tokens_do_not_count():
    values = torch.tensor([[1.0, 100.0, 3.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    assert masked_sum(values, mask).item() == 4.0


def test_kl_estimators_on_hand_values():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    log_ratio = math.log(2.0)
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(log_ratio)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5 * log_ratio**2)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(0.5 - 1 + log_ratio)
    for name in ("k1", "k2", "k3"):
        assert kl_estimate(logp, logp, name).item() == 0.0
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(logp, ref, "k4")


def test_entropy_of_uniform_distribution_is_log_vocab():
    assert token_entropy(torch.zeros(1, 8)).item() == pytest.approx(math.log(8))
