"""From generations to training sequences: overlong penalty, dynamic-sampling filter, truncation
mask, KL in reward and advantages, on hand-built generations (no engine needed)."""

import pytest

from rlsys.algorithms.advantages import assign_advantages
from rlsys.algorithms.samples import ScoredBatch, prepare, score_groups, to_train_sequences, truncated_fraction
from rlsys.algorithms.shaping import drop_uniform_groups
from rlsys.config import AlgorithmConfig, OverlongPenaltyConfig
from rlsys.data.tokenizer import load_tokenizer
from rlsys.records import Generation, PromptRecord
from rlsys.rewards.builtin import exact_match
from rlsys.rewards.pool import score_calls


def _generation(tokenizer, text: str, finish: str = "stop") -> Generation:
    ids = tokenizer(text)["input_ids"]
    return Generation([5, 6], ids, [-0.5] * len(ids), finish, 0)


def _score(tokenizer, records, generations, group_size, **kwargs) -> ScoredBatch:
    return score_groups(records, generations, group_size, tokenizer,
                        lambda calls: score_calls(exact_match, calls, timeout_s=10), **kwargs)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def test_dynamic_sampling_drops_groups_whose_scores_are_all_equal(tokenizer):
    records = [PromptRecord("a", "1"), PromptRecord("b", "2"), PromptRecord("c", "3")]
    texts = ["1", "0",   # mixed: kept
             "2", "2",   # all right: no gradient, dropped
             "0", "0"]   # all wrong: dropped
    batch = _score(tokenizer, records, [_generation(tokenizer, t) for t in texts], 2)
    batch.samples, batch.filtered_groups = drop_uniform_groups(batch.samples, 2)
    assert [s.record.prompt for s in batch.samples] == ["a", "a"]
    assert batch.filtered_groups == 2
    # reward_mean still covers every scored sample (3 right of 6), not only the kept ones
    assert batch.reward_metrics()["reward_mean"] == pytest.approx(0.5)


def test_overlong_penalty_shapes_the_score_and_can_make_a_group_informative(tokenizer):
    records = [PromptRecord("a", "7")]
    # Both answers are right; the second runs to max_new_tokens=4 (buffer 2: free up to 2 tokens).
    generations = [_generation(tokenizer, "7"), _generation(tokenizer, "7abc", finish="length")]
    batch = _score(tokenizer, records, generations, 2, overlong=OverlongPenaltyConfig(buffer_tokens=2, factor=0.5),
                   max_new_tokens=4)
    assert [s.reward for s in batch.samples] == [1.0, 0.0]  # "7abc" is not an exact match
    assert [s.shaping for s in batch.samples] == [0.0, -0.5]  # 4 tokens: (4 - 2) / 2 * 0.5
    assert batch.reward_metrics()["overlong_penalty_mean"] == pytest.approx(-0.25)
    assert len(drop_uniform_groups(batch.samples, 2)[0]) == 2
    metrics = assign_advantages(batch.samples, 2, "none")
    assert [s.advantage for s in batch.samples] == pytest.approx([0.75, -0.75])  # scores 1 and -0.5
    assert metrics["advantage_abs_mean"] == pytest.approx(0.75)


def test_truncated_responses_leave_the_loss_only_when_asked(tokenizer):
    records = [PromptRecord("a", "7")]
    generations = [_generation(tokenizer, "7"), _generation(tokenizer, "123", finish="length")]
    batch = _score(tokenizer, records, generations, 2)
    kept, masked = to_train_sequences(batch.samples), to_train_sequences(batch.samples, mask_truncated=True)
    assert [s.loss_mask for s in kept] == [None, None]
    assert masked[0].loss_mask is None and masked[1].loss_mask == [0, 0, 0]
    assert [s.loss_tokens for s in masked] == [1, 0]
    assert truncated_fraction(generations) == 0.5


def test_prepare_builds_the_steps_sequences_once_with_kl_shaped_advantages(tokenizer):
    """One list of training sequences per step: the KL-in-reward pass reads the very sequences
    the trainer then gets, their advantages from the KL-shaped scores, truncated ones masked."""
    records = [PromptRecord("a", "7")]
    generations = [_generation(tokenizer, "7"), _generation(tokenizer, "123", finish="length")]
    batch = _score(tokenizer, records, generations, 2)
    seen = []

    def sequence_kl(sequences):  # summed KL estimates the trainer would return: 1 and 3
        seen.append(sequences)
        return [1.0, 3.0]

    algorithm = AlgorithmConfig(kl_in_reward=True, kl_coef=0.5, mask_truncated=True, advantage_estimator="none")
    sequences, metrics = prepare(batch.samples, algorithm, 2, sequence_kl)
    assert len(seen) == 1 and seen[0] is sequences
    # scores 1 - 0.5 * 1 = 0.5 and 0 - 0.5 * 3 = -1.5: group mean -0.5
    assert [s.advantage for s in sequences] == pytest.approx([1.0, -1.0])
    assert [s.loss_mask for s in sequences] == [None, [0, 0, 0]]
    assert metrics == pytest.approx({"kl_reward_penalty": 1.0, "advantage_abs_mean": 1.0})


@pytest.mark.parametrize(("estimator", "advantages"), [
    ("rloo", [2.0, -2.0, 1.0, -1.0]),  # each score minus the other one of its group
    ("reinforce++", [a / (7 / 6) ** 0.5 for a in [0.5, -1.5, 1.0, 0.0]]),  # batch mean 0, variance 3.5 / 3
    ("reinforce++-baseline", [a / (5 / 6) ** 0.5 for a in [1.0, -1.0, 0.5, -0.5]]),  # centred; variance 2.5 / 3
])
def test_every_estimator_reads_the_kl_shaped_scores_of_the_whole_step(tokenizer, estimator, advantages):
    """KL in reward is the sequence's summed KL off its score before any estimator runs, and the
    batch statistics of REINFORCE++ cover every group of the step."""
    records = [PromptRecord("a", "7"), PromptRecord("b", "8")]
    generations = [_generation(tokenizer, t) for t in ["7", "0", "8", "8"]]  # rewards 1, 0, 1, 1
    batch = _score(tokenizer, records, generations, 2)
    algorithm = AlgorithmConfig(kl_in_reward=True, kl_coef=0.5, advantage_estimator=estimator)
    sequences, _ = prepare(batch.samples, algorithm, 2, lambda sequences: [1.0, 3.0, 0.0, 2.0])
    # scores 1 - 0.5, 0 - 1.5, 1 - 0, 1 - 1 = [0.5, -1.5, 1, 0]
    assert [s.advantage for s in sequences] == pytest.approx(advantages, rel=1e-5)


def test_prepare_leaves_a_step_with_no_loss_token_untrained(tokenizer):
    """Every response truncated and masked: no sequences, and no KL pass or advantages computed."""
    records = [PromptRecord("a", "7")]
    generations = [_generation(tokenizer, "12", finish="length"), _generation(tokenizer, "123", finish="length")]
    batch = _score(tokenizer, records, generations, 2)
    algorithm = AlgorithmConfig(kl_in_reward=True, kl_coef=0.5, mask_truncated=True)
    assert prepare(batch.samples, algorithm, 2, sequence_kl=lambda sequences: pytest.fail("KL computed")) == ([], {})


def test_a_step_with_no_scored_sample_reports_its_reward_as_missing_not_zero(tokenizer, tmp_path):
    """Every group's reward failed: metrics.jsonl, trackers, the status page and `rlsys runs` show no reward
    for the step, rather than a 0.0 that reads like a measured one."""
    from rlsys.observability.metrics import MetricsLog, read_metrics
    from rlsys.observability.runs import RunSummary
    from rlsys.observability.status.server import prometheus_text
    from rlsys.observability.status.state import RunStatus
    from rlsys.observability.tracking import numeric_metrics

    records = [PromptRecord("a", "1")]
    batch = score_groups(records, [_generation(tokenizer, t) for t in ("1", "0")], 2, tokenizer,
                         lambda calls: score_calls(lambda *a: float("nan"), calls, timeout_s=10))
    metrics = batch.reward_metrics()
    assert metrics["reward_errors"] == 2 and metrics["reward_mean"] is None and metrics["reward_std"] is None
    row = {"step": 0, **metrics}
    MetricsLog(tmp_path / "metrics.jsonl").append(row)
    assert read_metrics(tmp_path / "metrics.jsonl") == [row]  # null in the file
    assert "reward_mean" not in numeric_metrics(row) and numeric_metrics(row)["reward_errors"] == 2.0
    status = RunStatus(run_id="r", total_steps=1, run_dir=str(tmp_path))
    status.record_step(row)
    assert "rlsys_reward_mean" not in prometheus_text(status) and "rlsys_reward_errors 2" in prometheus_text(status)
    assert RunSummary.read(tmp_path).last_reward is None


def test_absurdly_large_rewards_are_counted_errors_and_large_ones_give_finite_advantages(tokenizer):
    """1e300 used to crash the driver computing reward_std (OverflowError); 1e30 (the largest taken) and
    its group give the same advantages as 1 and its group, finite in float32 where the loss uses them."""
    import math

    import torch

    records = [PromptRecord("a", "1"), PromptRecord("b", "1")]
    rewards = {"1": 1e300, "2": -1e30, "3": 1e30, "4": 0.0}
    batch = score_groups(records, [_generation(tokenizer, t) for t in ("1", "4", "3", "2")], 2, tokenizer,
                         lambda calls: score_calls(lambda p, response, label, m: rewards[response.strip()], calls,
                                                   timeout_s=10))
    metrics = batch.reward_metrics()
    assert metrics["reward_errors"] == 1 and batch.dropped_groups == 1
    assert "larger in magnitude than 1e+30" in batch.first_error
    assert metrics["reward_std"] == pytest.approx(1e30) and metrics["reward_mean"] == 0.0
    # as for rewards 1 and -1:
    assign_advantages(batch.samples, 2, "group")
    assert [s.advantage for s in batch.samples] == pytest.approx([math.sqrt(0.5), -math.sqrt(0.5)])
    assign_advantages(batch.samples, 2, "none")
    assert all(math.isfinite(float(torch.tensor(s.advantage, dtype=torch.float32))) for s in batch.samples)
