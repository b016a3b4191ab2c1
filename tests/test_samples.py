"""From generations to training sequences: overlong penalty, dynamic-sampling filter, truncation
mask and advantages, on hand-built generations (no engine needed)."""

import pytest

from rlsys.config import OverlongPenaltyConfig
from rlsys.data import PromptRecord
from rlsys.reward_pool import score_calls
from rlsys.rewards import exact_match
from rlsys.rollout.engine import Generation
from rlsys.samples import ScoredBatch, assign_advantages, score_groups, to_train_sequences, truncated_fraction
from rlsys.tiny_model import load_tokenizer


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
    batch.filter_uniform_groups(2)
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
    batch.filter_uniform_groups(2)
    assert len(batch.samples) == 2
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
