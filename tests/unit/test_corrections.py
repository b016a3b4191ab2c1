"""Rollout corrections (algorithm.corrections, rlsys/algorithms/corrections/) on hand-computed
micro-batches: each one's factor is its formula, written out here with its source; they combine by
multiplying; the trainer's mismatch metrics; the deprecated tis section still reads. That each equals
TRL 1.16's on a real update is tests/e2e/test_trl_equivalence.py's."""

import math

import pytest
import torch

from rlsys.actors.loss_sums import LossSums, mismatch_sums
from rlsys.algorithms.corrections import CorrectionInputs, correction_named
from rlsys.config import AlgorithmConfig

# Two packed sequences in one row: tokens 0-1 (A = +1) and 2-4 (A = -1); token 5 has no engine log-prob.
OLD = torch.log(torch.tensor([[0.5, 0.4, 0.9, 0.6, 0.3, 0.5]]))
ENGINE = torch.log(torch.tensor([[0.25, 0.8, 0.3, 0.2, 0.6, 0.5]]))  # rho: 2, 0.5 | 3, 3, 0.5 | -
ENGINE_MASK = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 0.0]])
RESPONSE_MASK = torch.ones(1, 6)
SPANS = [(0, 0, 2), (0, 2, 6)]
ADVANTAGES = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0, -1.0]])


def inputs(current=None) -> CorrectionInputs:
    current = OLD if current is None else current
    return CorrectionInputs(log_rho=(OLD - ENGINE) * ENGINE_MASK, engine_mask=ENGINE_MASK, response_mask=RESPONSE_MASK,
                            advantages=ADVANTAGES, logprobs=current,
                            sampling_logprobs=torch.where(ENGINE_MASK > 0, ENGINE, OLD), spans=SPANS)


def terms(**section):
    return correction_named(section).terms(inputs())


def test_token_truncation_is_tis_the_ratio_capped_and_a_token_without_engine_log_prob_weighs_one():
    out = terms(name="importance_sampling", max=2.5)
    assert torch.allclose(out.factor, torch.tensor([[2.0, 0.5, 2.5, 2.5, 0.5, 1.0]]))
    assert out.truncated.tolist() == [[0, 0, 1, 1, 0, 0]] and not out.masked.any()
    out = terms(name="importance_sampling", min=0.8, max=2.5)  # the lower bound too
    assert torch.allclose(out.factor, torch.tensor([[2.0, 0.8, 2.5, 2.5, 0.8, 1.0]]))


def test_token_mask_keeps_the_ratio_inside_the_bounds_and_zeroes_it_outside():
    out = terms(name="importance_sampling", mode="mask", min=0.6, max=2.5)
    assert torch.allclose(out.factor, torch.tensor([[2.0, 0.0, 0.0, 0.0, 0.0, 1.0]]))
    assert out.masked.tolist() == [[0, 1, 1, 1, 1, 0]] and not out.truncated.any()


def test_sequence_level_weights_are_the_product_of_the_responses_token_ratios():
    # sequence 1: 2 * 0.5 = 1; sequence 2: 3 * 3 * 0.5 = 4.5 (token 5 has no engine log-prob: ratio 1)
    out = terms(name="importance_sampling", level="sequence", max=4.0)
    assert torch.allclose(out.factor, torch.tensor([[1.0, 1.0, 4.0, 4.0, 4.0, 1.0]]))
    out = terms(name="importance_sampling", level="sequence", mode="mask", max=4.0)
    assert torch.allclose(out.factor, torch.tensor([[1.0, 1.0, 0.0, 0.0, 0.0, 1.0]]))


def test_icepop_keeps_rho_inside_alpha_beta_and_drops_the_token_outside():
    # IcePop ("Every Step Evolves", Ling team): M(rho) = rho if alpha <= rho <= beta else 0
    alpha, beta = 0.6, 2.5
    rho = [2.0, 0.5, 3.0, 3.0, 0.5, 1.0]
    expected = [r if alpha <= r <= beta else 0.0 for r in rho]
    out = terms(name="icepop", alpha=alpha, beta=beta)
    assert out.factor[0].tolist() == pytest.approx(expected)
    assert out.masked.tolist() == [[0, 1, 1, 1, 1, 0]]


def test_the_geometric_mask_drops_a_response_whose_mean_log_ratio_is_outside_the_bounds():
    # verl rollout_corr_math.md 3.3.3: rho_geo = exp(mean_t log rho_t); kept when low <= rho_geo <= high.
    # sequence 1: exp((log 2 + log 0.5) / 2) = 1; sequence 2: exp((2 log 3 + log 0.5) / 3) = 4.5^(1/3) ~ 1.65
    # (its fourth token has no engine log-prob: outside the mean)
    out = terms(name="geometric_mask", high=1.5)
    assert out.factor.tolist() == [[1, 1, 0, 0, 0, 0]]  # the whole response, its unscored token too
    assert terms(name="geometric_mask", high=1.7).factor.tolist() == [[1] * 6]
    assert terms(name="geometric_mask", low=1.01, high=2.0).factor.tolist() == [[0, 0, 1, 1, 1, 1]]
    assert correction_named({"name": "geometric_mask", "high": 1.25}).lower == pytest.approx(0.8)


def test_the_off_policy_mask_drops_only_negative_advantage_responses_the_policy_moved_far_from():
    # TRL 1.16 get_off_policy_mask: keep if A >= 0 or mean_t (log pi_sampling - log pi_theta) <= delta
    current = OLD.clone()
    current[0, :2] -= 1.0  # sequence 1 (A > 0) moved far: kept all the same
    sampling = torch.where(ENGINE_MASK > 0, ENGINE, OLD)
    divergence_2 = (sampling[0, 2:] - current[0, 2:]).mean().item()  # (log 1/3 + log 1/3 + log 2 + 0) / 4
    assert divergence_2 == pytest.approx((2 * math.log(1 / 3) + math.log(2)) / 4)
    correction = correction_named({"name": "off_policy_mask", "threshold": divergence_2 + 1e-3})
    assert correction.terms(inputs(current)).factor.tolist() == [[1] * 6]
    correction = correction_named({"name": "off_policy_mask", "threshold": divergence_2 - 1e-3})
    assert correction.terms(inputs(current)).factor.tolist() == [[1, 1, 0, 0, 0, 0]]  # sequence 1 kept: A > 0


def test_corrections_multiply_weights_into_the_loss_and_masks_after_it():
    from tests.unit.test_policy_losses import run

    engine = [[-1.0 - math.log(2), -1.0, -1.0], [-1.0 + math.log(4), -1.0, -1.0]]  # rho 2 | 0.25, 1, 1
    icepop = AlgorithmConfig(corrections=["icepop"])
    both = AlgorithmConfig(corrections=["icepop", {"name": "geometric_mask", "high": 1.1}])
    plain = AlgorithmConfig(corrections=[])
    _, grads_plain, _, _, _ = run(plain, engine_logprobs=engine)
    _, grads_icepop, _, loss, _ = run(icepop, engine_logprobs=engine)
    factor = [2.0, 1.0, 1.0, 0.0, 1.0, 1.0]  # 0.25 < alpha 0.5: dropped
    assert grads_icepop == pytest.approx([g * f for g, f in zip(grads_plain, factor, strict=True)])
    # geometric means: 2^(1/3) ~ 1.26 and 0.25^(1/3) ~ 0.63, both outside [1/1.1, 1.1]: nothing trains
    _, grads_both, _, loss, _ = run(both, engine_logprobs=engine)
    assert grads_both == [0.0] * 6 and loss.corrected.rejected.sum().item() == 6


def test_the_mismatch_metrics_are_k1_k3_and_the_ratios_extremes():
    sums = LossSums(**mismatch_sums(OLD, ENGINE, ENGINE_MASK), engine_tokens=5.0, tokens=6.0)
    sums += LossSums()  # a micro-batch without engine tokens changes nothing
    rho = [2.0, 0.5, 3.0, 3.0, 0.5]
    metrics = sums.metrics(with_corrections=False, policy_loss=AlgorithmConfig().policy_loss)
    assert metrics["rollout_k1"] == pytest.approx(sum(-math.log(r) for r in rho) / 5)
    assert metrics["rollout_k3"] == pytest.approx(sum(r - math.log(r) - 1 for r in rho) / 5)
    assert (metrics["rollout_ratio_min"], metrics["rollout_ratio_max"]) == pytest.approx((0.5, 3.0))
    assert metrics["rollout_ratio_mean"] == pytest.approx(9.0 / 5)
    assert "masked_token_fraction" not in metrics
    assert "rollout_k1" not in LossSums().metrics(with_corrections=False, policy_loss=AlgorithmConfig().policy_loss)


def test_the_deprecated_tis_section_reads_as_corrections(caplog):
    assert AlgorithmConfig(tis={"enabled": True, "cap": 3.0, "level": "sequence"}).corrections == [
        correction_named({"name": "importance_sampling", "level": "sequence", "max": 3.0})]
    assert AlgorithmConfig(tis={"enabled": False}).corrections == []
    capped = AlgorithmConfig(tis={"cap": 1.5})  # no `enabled`: what an off-policy run gets
    assert capped.corrections is None
    assert capped.resolved(8, off_policy=True).corrections[0].max == 1.5
    assert capped.resolved(8, off_policy=False).corrections == []
    assert "algorithm.tis is deprecated: write algorithm.corrections" in caplog.text
    with pytest.raises(ValueError, match="tis and corrections are both set"):
        AlgorithmConfig(tis={"enabled": True}, corrections=["icepop"])


@pytest.mark.parametrize(("section", "message"), [
    ({"name": "importance_sampling", "min": 3.0, "max": 2.0}, "min 3.0 is above max 2.0"),
    ({"name": "icepop", "alpha": 6.0}, "alpha 6.0 is above beta 5.0"),
    ({"name": "tis"}, "unknown correction 'tis' .one of"),
    ({"name": "off_policy_mask"}, "threshold"),
])
def test_a_bad_correction_is_refused_naming_what_to_change(section, message):
    with pytest.raises(ValueError, match=message):
        AlgorithmConfig(corrections=[section])
