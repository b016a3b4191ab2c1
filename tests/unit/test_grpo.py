"""GRPO math on hand-computed cases."""

import math
import typing

import pytest
import torch

from rlsys.algorithms.advantages import ADVANTAGE_ESTIMATORS, group_advantages
from rlsys.algorithms.grpo import (
    clipped_policy_loss,
    kl_estimate,
    masked_sum,
    overlong_penalty,
)
from rlsys.algorithms.losses import LOSS_AGGREGATIONS, sequence_loss_weights
from rlsys.algorithms.policy_losses import POLICY_LOSSES
from rlsys.config import AlgorithmConfig


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
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), group_size=4, norm="none")
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


# ---- GRPO toolkit: advantage scaling, loss aggregation, overlong penalty, TIS --------------------

def test_batch_advantage_norm_uses_group_baseline_and_batch_std():
    rewards = torch.tensor([1.0, 0.0, 3.0, 3.0])
    # group means 0.5 and 3 -> centred [0.5, -0.5, 0, 0]; batch std of [1, 0, 3, 3] = sqrt(11/4 - ...)
    batch_std = torch.tensor([1.0, 0.0, 3.0, 3.0]).std(unbiased=True).item()  # 1.5
    assert batch_std == pytest.approx(1.5)
    adv = group_advantages(rewards, group_size=2, norm="batch", eps=0.0)
    assert torch.allclose(adv, torch.tensor([0.5 / 1.5, -0.5 / 1.5, 0.0, 0.0]))
    with pytest.raises(ValueError, match="unknown advantage normalisation"):
        group_advantages(rewards, group_size=2, norm="rank")


# Two groups of 3: [1, 0, 0] (mean 1/3) and [1, 1, 0] (mean 2/3); batch mean 1/2.
TWO_GROUPS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])


def test_rloo_baseline_is_the_mean_of_the_other_samples_of_the_group():
    adv = group_advantages(TWO_GROUPS, group_size=3, norm="rloo")
    # 1 - mean(0, 0); 0 - mean(1, 0) twice | 1 - mean(1, 0) twice; 0 - mean(1, 1)
    assert torch.allclose(adv, torch.tensor([1.0, -0.5, -0.5, 0.5, 0.5, -1.0]))
    # n = 2: each sample's baseline is the other one's score
    assert torch.allclose(group_advantages(torch.tensor([3.0, 1.0, 2.0, 2.0]), 2, norm="rloo"),
                          torch.tensor([2.0, -2.0, 0.0, 0.0]))
    with pytest.raises(ValueError, match="rloo needs at least 2 samples per group"):
        group_advantages(torch.tensor([1.0, 0.0]), group_size=1, norm="rloo")


def test_reinforce_plus_plus_normalises_over_the_whole_batch_without_group_baseline():
    # batch mean 1/2, deviations +-1/2: unbiased variance 6 * 1/4 / 5 = 0.3
    adv = group_advantages(TWO_GROUPS, group_size=3, norm="reinforce++", eps=0.0)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, -1.0]) * 0.5 / math.sqrt(0.3))


def test_reinforce_plus_plus_baseline_centres_groups_then_normalises_over_the_batch():
    # group-centred: [2/3, -1/3, -1/3, 1/3, 1/3, -2/3] (batch mean 0); unbiased variance (12/9) / 5 = 4/15
    adv = group_advantages(TWO_GROUPS, group_size=3, norm="reinforce++-baseline", eps=0.0)
    centred = torch.tensor([2.0, -1.0, -1.0, 1.0, 1.0, -2.0]) / 3
    assert torch.allclose(adv, centred / math.sqrt(4 / 15))
    # not the batch estimator, which divides by the std of the raw scores (sqrt(0.3))
    assert not torch.allclose(adv, group_advantages(TWO_GROUPS, group_size=3, norm="batch", eps=0.0))


@pytest.mark.parametrize("estimator", ["group", "batch", "none", "rloo", "reinforce++", "reinforce++-baseline"])
def test_a_batch_of_equal_scores_gets_zero_advantages(estimator):
    adv = group_advantages(torch.full((6,), 0.7), group_size=3, norm=estimator)
    assert torch.equal(adv, torch.zeros(6))


def test_adv_norm_is_read_as_advantage_estimator():
    assert AlgorithmConfig(adv_norm="none").advantage_estimator == "none"
    assert AlgorithmConfig().advantage_estimator == "group"  # the default is unchanged
    with pytest.raises(ValueError, match="renamed advantage_estimator"):
        AlgorithmConfig(adv_norm="none", advantage_estimator="rloo")


def test_loss_weights_for_each_aggregation_mode():
    tokens = [2, 4, 0, 6]  # the third sequence is masked out entirely
    assert sequence_loss_weights(tokens, "token-mean") == pytest.approx([1 / 12, 1 / 12, 0.0, 1 / 12])
    # three sequences count: each weighs 1/3, spread over its own tokens
    assert sequence_loss_weights(tokens, "seq-mean-token-mean") == pytest.approx([1 / 6, 1 / 12, 0.0, 1 / 18])
    assert sequence_loss_weights(tokens, "seq-mean-token-sum-norm", norm_tokens=8) == pytest.approx(
        [1 / 24, 1 / 24, 0.0, 1 / 24])
    with pytest.raises(ValueError, match="norm_tokens"):
        sequence_loss_weights(tokens, "seq-mean-token-sum-norm")
    assert sequence_loss_weights([0, 0], "token-mean") == [0.0, 0.0]


def test_aggregated_loss_matches_hand_computed_means():
    # Token losses of two sequences: [1, 3] and [2, 2, 2, 6]
    losses = [[1.0, 3.0], [2.0, 2.0, 2.0, 6.0]]
    def total(mode, norm=None):
        weights = sequence_loss_weights([len(seq) for seq in losses], mode, norm)
        return sum(w * sum(seq) for w, seq in zip(weights, losses, strict=True))
    assert total("token-mean") == pytest.approx(16 / 6)
    assert total("seq-mean-token-mean") == pytest.approx((2 + 3) / 2)
    assert total("seq-mean-token-sum-norm", 10) == pytest.approx((4 / 10 + 12 / 10) / 2)


def test_overlong_penalty_is_dapo_soft_punishment():
    # max 10 tokens, buffer 4: free up to 6, then -factor * (len - 6) / 4
    assert overlong_penalty(6, 10, 4, 1.0) == 0.0
    assert overlong_penalty(7, 10, 4, 1.0) == pytest.approx(-0.25)
    assert overlong_penalty(10, 10, 4, 0.5) == pytest.approx(-0.5)
    assert overlong_penalty(3, 10, 4, 1.0) == 0.0


def test_every_config_name_has_a_registered_estimator_loss_and_aggregation():
    """The config's choices and the registries name the same things: a name added to one and not
    the other is refused here, not in the middle of a run."""
    fields = AlgorithmConfig.model_fields
    assert set(ADVANTAGE_ESTIMATORS) == set(typing.get_args(fields["advantage_estimator"].annotation))
    aggregations, none = typing.get_args(fields["loss_agg_mode"].annotation)  # Literal[...] | None
    assert set(LOSS_AGGREGATIONS) == set(typing.get_args(aggregations)) and none is type(None)
    assert {"grpo", "gspo", "luspo", "cispo", "sapo", "vespo"} <= set(POLICY_LOSSES)
    for policy_loss in POLICY_LOSSES:  # each loss's own aggregation is a registered one
        assert AlgorithmConfig(policy_loss=policy_loss).aggregation in LOSS_AGGREGATIONS
