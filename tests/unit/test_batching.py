"""Micro-batch layout (packed and padded) and the two ways of splitting sequences, checked against
tensors computed by hand. Position t predicts token t + 1, so a sequence of prompt length P and
total length L at row offset o has its response targets at o + P - 1 .. o + L - 2."""

from __future__ import annotations

import pytest
import torch

from rlsys.actors.batching import build_micro_batch, split_by_token_budget, split_evenly
from rlsys.records import TrainSequence

CPU = torch.device("cpu")
PAD = 99


def _sequences() -> list[TrainSequence]:
    return [
        # prompt [11, 12], response [13, 14]: row offset 0, targets 1 .. 2
        TrainSequence([11, 12, 13, 14], prompt_len=2, advantage=0.5, engine_logprobs=[-0.25, -0.5]),
        # prompt [21], response [22, 23], no engine log-probs: row offset 4, targets 4 .. 5
        TrainSequence([21, 22, 23], prompt_len=1, advantage=-1.0),
        # prompt [31, 32, 33], response [34, 35]: row offset 7, targets 9 .. 10
        TrainSequence([31, 32, 33, 34, 35], prompt_len=3, advantage=2.0, engine_logprobs=[-1.0, -2.0]),
    ]


# ---------------------------------------------------------------- packed


def test_packed_puts_every_sequence_back_to_back_in_one_row():
    batch = build_micro_batch(_sequences(), [7, 2, 5], pad_id=PAD, device=CPU, packed=True)
    assert batch.input_ids.dtype == torch.long
    assert batch.input_ids.tolist() == [[11, 12, 13, 14, 21, 22, 23, 31, 32, 33, 34, 35]]
    assert batch.targets.tolist() == [[12, 13, 14, 21, 22, 23, 31, 32, 33, 34, 35]]
    assert batch.indices == [7, 2, 5]


def test_packed_positions_restart_for_every_sequence():
    batch = build_micro_batch(_sequences(), [0, 1, 2], pad_id=PAD, device=CPU, packed=True)
    assert batch.position_ids.dtype == torch.long
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]]


def test_packed_has_no_attention_mask_and_model_inputs_omit_it():
    batch = build_micro_batch(_sequences(), [0, 1, 2], pad_id=PAD, device=CPU, packed=True)
    assert batch.attention_mask is None
    inputs = batch.model_inputs()
    assert set(inputs) == {"input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                           "max_length_k"}
    assert inputs["input_ids"] is batch.input_ids and inputs["position_ids"] is batch.position_ids


def test_packed_sequence_boundaries_equal_what_transformers_derives_from_the_positions():
    """flash-attn's varlen arguments come with the micro-batch; they must be exactly those that
    transformers would otherwise compute from position_ids in every layer."""
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    for sequences in (_sequences(), _sequences()[1:2], []):
        batch = build_micro_batch(sequences, list(range(len(sequences))), pad_id=PAD, device=CPU, packed=True)
        (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(batch.position_ids)
        inputs = batch.model_inputs()
        assert inputs["cu_seq_lens_q"].dtype == cu_q.dtype == torch.int32
        assert inputs["cu_seq_lens_q"].tolist() == inputs["cu_seq_lens_k"].tolist() == cu_q.tolist() == cu_k.tolist()
        assert type(inputs["max_length_q"]) is int  # a host int: no device sync to read it
        assert inputs["max_length_q"] == inputs["max_length_k"] == int(max_q) == int(max_k)
    assert build_micro_batch(_sequences(), [0, 1, 2], pad_id=PAD, device=CPU, packed=True).cu_seq_lens.tolist() \
        == [0, 4, 7, 12]


def test_packed_spans_are_the_target_positions_of_each_response():
    batch = build_micro_batch(_sequences(), [0, 1, 2], pad_id=PAD, device=CPU, packed=True)
    # (row, o + P - 1, o + L - 1): offsets 0, 4, 7
    assert batch.spans == [(0, 1, 3), (0, 4, 6), (0, 9, 11)]
    for seq, (row, first, end) in zip(_sequences(), batch.spans, strict=True):
        assert batch.targets[row, first:end].tolist() == seq.token_ids[seq.prompt_len:]


def test_packed_per_token_tensors_sit_exactly_on_the_response_targets():
    batch = build_micro_batch(_sequences(), [0, 1, 2], pad_id=PAD, device=CPU, packed=True)
    # target positions:      0  1     2     3  4     5     6  7  8  9     10
    assert batch.response_mask.tolist() == [[0, 1, 1, 0, 1, 1, 0, 0, 0, 1, 1]]
    assert batch.advantages.tolist() == [[0, 0.5, 0.5, 0, -1.0, -1.0, 0, 0, 0, 2.0, 2.0]]
    assert batch.engine_logprobs.tolist() == [[0, -0.25, -0.5, 0, 0, 0, 0, 0, 0, -1.0, -2.0]]
    # the second sequence has no engine log-probs, so its response is outside the engine mask
    assert batch.engine_mask.tolist() == [[0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1]]
    for name in ("response_mask", "advantages", "engine_logprobs", "engine_mask"):
        tensor = getattr(batch, name)
        assert tensor.shape == (1, 11) and tensor.dtype == torch.float32, name
    assert batch.num_tokens == 6.0
    assert batch.old_logprobs is None and batch.ref_logprobs is None


def test_packed_boundary_target_between_sequences_is_masked_out():
    # position 3 (last token of the first sequence) "predicts" 21, the first token of the next one
    batch = build_micro_batch(_sequences(), [0, 1, 2], pad_id=PAD, device=CPU, packed=True)
    assert batch.targets[0, 3].item() == 21 and batch.targets[0, 6].item() == 31
    assert batch.response_mask[0, 3].item() == 0 and batch.response_mask[0, 6].item() == 0


# ---------------------------------------------------------------- padded


def test_padded_gives_one_right_padded_row_per_sequence():
    batch = build_micro_batch(_sequences(), [0, 1, 2], pad_id=PAD, device=CPU, packed=False)
    assert batch.input_ids.tolist() == [[11, 12, 13, 14, PAD], [21, 22, 23, PAD, PAD], [31, 32, 33, 34, 35]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 0], [0, 1, 2, 0, 0], [0, 1, 2, 3, 4]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert batch.targets.tolist() == [[12, 13, 14, PAD], [22, 23, PAD, PAD], [32, 33, 34, 35]]


def test_padded_model_inputs_include_the_attention_mask():
    batch = build_micro_batch(_sequences(), [0, 1, 2], pad_id=PAD, device=CPU, packed=False)
    assert set(batch.model_inputs()) == {"input_ids", "position_ids", "attention_mask"}
    assert batch.model_inputs()["attention_mask"] is batch.attention_mask


def test_padded_spans_and_per_token_tensors_sit_on_each_rows_response_targets():
    batch = build_micro_batch(_sequences(), [0, 1, 2], pad_id=PAD, device=CPU, packed=False)
    assert batch.spans == [(0, 1, 3), (1, 0, 2), (2, 2, 4)]
    assert batch.response_mask.tolist() == [[0, 1, 1, 0], [1, 1, 0, 0], [0, 0, 1, 1]]
    assert batch.advantages.tolist() == [[0, 0.5, 0.5, 0], [-1.0, -1.0, 0, 0], [0, 0, 2.0, 2.0]]
    assert batch.engine_logprobs.tolist() == [[0, -0.25, -0.5, 0], [0, 0, 0, 0], [0, 0, -1.0, -2.0]]
    assert batch.engine_mask.tolist() == [[0, 1, 1, 0], [0, 0, 0, 0], [0, 0, 1, 1]]
    for seq, (row, first, end) in zip(_sequences(), batch.spans, strict=True):
        assert batch.targets[row, first:end].tolist() == seq.token_ids[seq.prompt_len:]
    assert batch.num_tokens == 6.0


@pytest.mark.parametrize("packed", [True, False])
def test_sequence_without_response_contributes_an_empty_span(packed):
    seqs = [TrainSequence([1, 2, 3], prompt_len=3, advantage=4.0), TrainSequence([5, 6], prompt_len=1, advantage=1.0)]
    batch = build_micro_batch(seqs, [0, 1], pad_id=PAD, device=CPU, packed=packed)
    if packed:
        assert batch.spans == [(0, 2, 2), (0, 3, 4)]
        assert batch.response_mask.tolist() == [[0, 0, 0, 1]]
        assert batch.advantages.tolist() == [[0, 0, 0, 1.0]]
    else:
        assert batch.spans == [(0, 2, 2), (1, 0, 1)]
        assert batch.response_mask.tolist() == [[0, 0], [1, 0]]
        assert batch.advantages.tolist() == [[0, 0], [1.0, 0]]


# ---------------------------------------------------------------- dummy row and errors


@pytest.mark.parametrize("packed", [True, False])
def test_empty_list_gives_a_two_token_dummy_row_with_zero_masks_and_no_spans(packed):
    batch = build_micro_batch([], [], pad_id=PAD, device=CPU, packed=packed)
    assert batch.input_ids.tolist() == [[PAD, PAD]]
    assert batch.position_ids.tolist() == [[0, 1]]
    assert batch.targets.tolist() == [[PAD]]
    assert batch.response_mask.tolist() == [[0.0]]
    assert batch.engine_mask.tolist() == [[0.0]]
    assert batch.advantages.tolist() == [[0.0]]
    assert batch.engine_logprobs.tolist() == [[0.0]]
    assert batch.spans == [] and batch.indices == []
    assert batch.num_tokens == 0.0
    assert (batch.attention_mask is None) == packed


def test_dummy_row_drops_any_indices_passed_with_an_empty_list():
    batch = build_micro_batch([], [4, 5], pad_id=PAD, device=CPU, packed=True)
    assert batch.indices == []


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("prompt_len", [0, 4])
def test_prompt_length_outside_the_sequence_is_rejected(packed, prompt_len):
    seqs = [TrainSequence([1, 2, 3], prompt_len=1), TrainSequence([4, 5, 6], prompt_len=prompt_len)]
    with pytest.raises(ValueError, match=rf"needs 1\.\.3 prompt tokens \(got {prompt_len}\)"):
        build_micro_batch(seqs, [0, 1], pad_id=PAD, device=CPU, packed=packed)


@pytest.mark.parametrize("engine_logprobs", [[-1.0], [-1.0, -2.0, -3.0]])
@pytest.mark.parametrize("packed", [True, False])
def test_wrong_number_of_engine_logprobs_is_rejected(packed, engine_logprobs):
    seqs = [TrainSequence([1, 2, 3, 4], prompt_len=2, engine_logprobs=engine_logprobs)]
    with pytest.raises(ValueError, match=f"{len(engine_logprobs)} engine log-probs for 2 response tokens"):
        build_micro_batch(seqs, [0], pad_id=PAD, device=CPU, packed=packed)


# ---------------------------------------------------------------- split_evenly


@pytest.mark.parametrize(
    ("count", "parts", "expected"),
    [
        (7, 3, [[0, 1, 2], [3, 4], [5, 6]]),
        (6, 3, [[0, 1], [2, 3], [4, 5]]),
        (2, 4, [[0], [1], [], []]),
        (0, 3, [[], [], []]),
        (5, 1, [[0, 1, 2, 3, 4]]),
    ],
)
def test_split_evenly_gives_contiguous_chunks_in_order(count, parts, expected):
    assert split_evenly(list(range(count)), parts) == expected


@pytest.mark.parametrize("count", range(0, 12))
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 5])
def test_split_evenly_sizes_differ_by_at_most_one_and_keep_every_item(count, parts):
    items = [f"item{i}" for i in range(count)]
    chunks = split_evenly(items, parts)
    assert len(chunks) == parts
    assert [item for chunk in chunks for item in chunk] == items
    sizes = [len(chunk) for chunk in chunks]
    assert max(sizes) - min(sizes) <= 1


# ---------------------------------------------------------------- split_by_token_budget


def test_token_budget_groups_consecutive_sequences_and_puts_an_over_long_one_alone():
    lengths = [3, 4, 2, 10, 1, 1]
    # 3 + 4 = 7 fits exactly; 2 cannot join; 10 is over budget and goes alone; 1 + 1 fit together
    assert split_by_token_budget(lengths, [0, 1, 2, 3, 4, 5], max_tokens=7) == [[0, 1], [2], [3], [4, 5]]


def test_token_budget_reads_lengths_by_index_and_keeps_the_given_order():
    lengths = [3, 4, 2, 10, 1, 1]
    assert split_by_token_budget(lengths, [5, 3, 0], max_tokens=7) == [[5], [3], [0]]
    assert split_by_token_budget(lengths, [4, 5, 2, 0], max_tokens=7) == [[4, 5, 2, 0]]


def test_token_budget_over_long_first_sequence_goes_alone():
    assert split_by_token_budget([9, 1, 1], [0, 1, 2], max_tokens=5) == [[0], [1, 2]]


def test_token_budget_of_nothing_is_no_groups():
    assert split_by_token_budget([3, 4], [], max_tokens=7) == []


@pytest.mark.parametrize("max_tokens", [1, 4, 6, 8, 20])
def test_token_budget_groups_stay_within_budget_unless_single(max_tokens):
    lengths = [5, 1, 3, 7, 2, 2, 4, 1]
    indices = list(range(len(lengths)))
    groups = split_by_token_budget(lengths, indices, max_tokens)
    assert [i for group in groups for i in group] == indices
    for group in groups:
        assert len(group) == 1 or sum(lengths[i] for i in group) <= max_tokens
    # greedy: the first sequence of the next group would not have fit into this one
    for group, following in zip(groups, groups[1:], strict=False):
        assert sum(lengths[i] for i in group) + lengths[following[0]] > max_tokens


# ---------------------------------------------------------------- loss mask and weights


@pytest.mark.parametrize("packed", [True, False])
def test_loss_mask_and_weights_sit_on_the_response_targets(packed):
    sequences = _sequences()
    sequences[0].loss_mask, sequences[0].loss_weight = [1, 0], 0.25
    sequences[2].loss_mask, sequences[2].loss_weight = [0, 0], 0.5
    batch = build_micro_batch(sequences, [0, 1, 2], PAD, CPU, packed)
    for (row, first, end), seq in zip(batch.spans, sequences, strict=True):
        mask = [1.0] * seq.response_len if seq.loss_mask is None else [float(m) for m in seq.loss_mask]
        assert batch.response_mask[row, first:end].tolist() == mask
        weight = 1.0 if seq.loss_weight is None else seq.loss_weight
        assert batch.loss_weights[row, first:end].tolist() == [weight * m for m in mask]
        if seq.engine_logprobs:  # engine tokens are loss tokens only
            assert batch.engine_mask[row, first:end].tolist() == mask
    assert batch.num_tokens == 1 + 2 + 0
    assert batch.loss_weights.sum().item() == pytest.approx(0.25 + 2.0)  # unweighted sequences weigh 1


def test_loss_mask_of_the_wrong_length_is_rejected():
    with pytest.raises(ValueError, match="loss mask of 1 values for 2 response tokens"):
        build_micro_batch([TrainSequence([1, 2, 3], prompt_len=1, loss_mask=[1])], [0], PAD, CPU, packed=True)
