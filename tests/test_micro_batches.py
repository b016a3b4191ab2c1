"""Micro-batches laid out by hand: packed rows restart positions per sequence, padded rows hold
one sequence each, and the response targets sit exactly where the trainer reads them."""

import pytest
import torch

from rlsys.actors.batching import TrainSequence, build_micro_batch, split_by_token_budget, split_evenly

CPU = torch.device("cpu")


def _two_sequences() -> list[TrainSequence]:
    # prompt [5, 6], response [7, 8, 9]; prompt [10], response [11]
    return [TrainSequence([5, 6, 7, 8, 9], prompt_len=2, advantage=0.5, engine_logprobs=[-1.0, -2.0, -3.0]),
            TrainSequence([10, 11], prompt_len=1, advantage=-1.0)]


def test_packed_row_holds_every_sequence_with_positions_restarting():
    batch = build_micro_batch(_two_sequences(), [3, 8], pad_id=0, device=CPU, packed=True)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1]]
    assert batch.attention_mask is None  # transformers attends block-causally from position_ids
    assert batch.targets.tolist() == [[6, 7, 8, 9, 10, 11]]
    # position t predicts token t + 1: responses are targets 1..3 (7, 8, 9) and 5 (11)
    assert batch.spans == [(0, 1, 4), (0, 5, 6)]
    assert batch.response_mask.tolist() == [[0, 1, 1, 1, 0, 1]]
    assert batch.advantages.tolist() == [[0, 0.5, 0.5, 0.5, 0, -1.0]]
    assert batch.engine_logprobs.tolist() == [[0, -1.0, -2.0, -3.0, 0, 0]]
    assert batch.engine_mask.tolist() == [[0, 1, 1, 1, 0, 0]]  # the second has no engine log-probs
    assert batch.indices == [3, 8] and batch.num_tokens == 4.0


def test_padded_rows_hold_one_sequence_each_right_padded():
    batch = build_micro_batch(_two_sequences(), [0, 1], pad_id=0, device=CPU, packed=False)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [10, 11, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 0, 0, 0]]
    assert batch.spans == [(0, 1, 4), (1, 0, 1)]
    assert batch.response_mask.tolist() == [[0, 1, 1, 1], [1, 0, 0, 0]]


def test_an_empty_micro_batch_is_a_dummy_row_that_counts_nothing():
    batch = build_micro_batch([], [], pad_id=0, device=CPU, packed=True)
    assert batch.input_ids.shape == (1, 2) and batch.spans == [] and batch.indices == []
    assert batch.response_mask.sum() == 0 and batch.engine_mask.sum() == 0 and batch.num_tokens == 0


def test_malformed_sequences_are_refused():
    with pytest.raises(ValueError, match="at least one prompt token"):
        build_micro_batch([TrainSequence([1, 2], prompt_len=0)], [0], 0, CPU, packed=True)
    with pytest.raises(ValueError, match="2 engine log-probs for 3 response tokens"):
        build_micro_batch([TrainSequence([1, 2, 3, 4], 1, engine_logprobs=[0.0, 0.0])], [0], 0, CPU, packed=True)


def test_even_split_keeps_order_and_sizes_within_one():
    assert split_evenly(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_evenly([1, 2], 4) == [[1], [2], [], []]


def test_token_budget_groups_consecutive_sequences_and_lets_a_long_one_go_alone():
    lengths = [3, 4, 10, 2, 2, 2]
    assert split_by_token_budget(lengths, [0, 1, 2, 3, 4, 5], max_tokens=8) == [[0, 1], [2], [3, 4, 5]]
    assert split_by_token_budget(lengths, [3, 4], max_tokens=8) == [[3, 4]]
