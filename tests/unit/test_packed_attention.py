"""Packed SDPA: a packed row attends within each sequence, exactly as each sequence alone would,
without a pack-length mask; padded rows keep transformers' SDPA."""

from __future__ import annotations

import pytest
import torch
import transformers

from rlsys.actors.packed_attention import PACKED_SDPA, register_packed_sdpa, sequence_starts
from rlsys.tools.tiny_parts import ARCHITECTURES, TinyModelSpec

LENGTHS = [5, 9, 5, 1, 13, 9, 5]  # repeated lengths share one SDPA call; a one-token sequence


def _model(attention: str, arch: str = "qwen2"):
    """A small random model of `arch` (rlsys make-tiny-model's architectures and their fields)."""
    register_packed_sdpa()
    config_class, model_class = (getattr(transformers, name) for name in ARCHITECTURES[arch])
    spec = TinyModelSpec(hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64, arch=arch)
    config = config_class(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
                          **spec.config_fields())
    torch.manual_seed(0)
    model = model_class(config)
    model.config._attn_implementation = attention
    return model


def _sequences() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 50, (n,), generator=generator) for n in LENGTHS]


# The causal LMs (a vision-language model's packing needs its 3-row positions: not wired yet, #62)
@pytest.mark.parametrize("arch", [arch for arch, (_, model) in ARCHITECTURES.items() if model.endswith("ForCausalLM")])
def test_a_packed_row_gives_each_sequences_own_logits_and_gradients(arch):
    model = _model(PACKED_SDPA, arch)
    sequences = _sequences()
    packed_ids = torch.cat(sequences)[None]
    positions = torch.cat([torch.arange(len(s)) for s in sequences])[None]
    packed = model(input_ids=packed_ids, position_ids=positions).logits[0]
    packed.square().mean().backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]

    model.zero_grad()
    model.config._attn_implementation = "sdpa"  # transformers' own SDPA, one sequence at a time
    alone = torch.cat([model(input_ids=s[None]).logits[0] for s in sequences])
    alone.square().mean().backward()

    # Same sums in the same order per sequence: only SDPA's batch-size-dependent blocking differs.
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-6)
    for packed_grad, param in zip(packed_grads, model.parameters(), strict=True):
        torch.testing.assert_close(packed_grad, param.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(("attention", "longest_attended"), [(PACKED_SDPA, max(LENGTHS)), ("sdpa", sum(LENGTHS))])
def test_a_packed_row_attends_over_its_sequences_not_the_pack(monkeypatch, attention, longest_attended):
    """The cost is the sum of len^2: no SDPA call spans more than the longest sequence, and none
    takes a mask. (transformers' SDPA, the second case, attends over the pack with a dense mask.)"""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording_sdpa(query, key, value, attn_mask=None, **kwargs):
        calls.append((key.shape[-2], attn_mask is not None))
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa)
    model = _model(attention)
    sequences = _sequences()
    positions = torch.cat([torch.arange(len(s)) for s in sequences])[None]
    model(input_ids=torch.cat(sequences)[None], position_ids=positions)
    assert max(length for length, _ in calls) == longest_attended
    assert any(masked for _, masked in calls) == (attention == "sdpa")
    if attention == PACKED_SDPA:
        assert len(calls) == 2 * len(set(LENGTHS))  # one call per distinct length and layer


def test_padded_rows_attend_as_transformers_sdpa():
    model = _model(PACKED_SDPA)
    ids = torch.randint(0, 50, (3, 11), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, 7:] = 0
    mask[2, 4:] = 0
    ours = model(input_ids=ids, attention_mask=mask).logits
    model.config._attn_implementation = "sdpa"
    theirs = model(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()
    assert torch.equal(ours[keep], theirs[keep])


@pytest.mark.parametrize(("positions", "expected"), [
    ([0, 1, 2, 0, 1, 0], [0, 3, 5]),
    ([0, 1, 2, 3], [0]),
])
def test_sequence_starts_follow_position_resets(positions, expected):
    assert sequence_starts(torch.tensor(positions)) == expected


def test_the_micro_batchs_sequence_boundaries_reach_the_attention_and_give_the_same_logits(monkeypatch):
    """The model passes MicroBatch.model_inputs()'s cu_seq_lens/max_length down to every layer's
    attention (flash-attn's varlen arguments on a GPU); the packed SDPA uses them instead of the
    position resets, with the same result."""
    from transformers import AttentionInterface

    from rlsys.actors import packed_attention
    from rlsys.actors.batching import build_micro_batch
    from rlsys.records import TrainSequence

    seen = []

    def recording(module, query, key, value, attention_mask, **kwargs):
        seen.append({k: kwargs.get(k) for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")})
        return packed_attention.packed_sdpa_attention(module, query, key, value, attention_mask, **kwargs)

    model = _model(PACKED_SDPA)
    sequences = [TrainSequence(s.tolist(), prompt_len=1) for s in _sequences()]
    batch = build_micro_batch(sequences, list(range(len(sequences))), pad_id=0, device=torch.device("cpu"),
                              packed=True)
    without = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
    AttentionInterface.register("recording_packed", recording)
    model.config._attn_implementation = "recording_packed"
    monkeypatch.setattr(packed_attention, "sequence_starts", lambda positions: pytest.fail("re-derived"))
    with_boundaries = model(**batch.model_inputs()).logits
    assert len(seen) == model.config.num_hidden_layers
    expected = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    for call in seen:
        assert call["cu_seq_lens_q"].tolist() == call["cu_seq_lens_k"].tolist() == expected
        assert call["max_length_q"] == call["max_length_k"] == max(LENGTHS)
    torch.testing.assert_close(with_boundaries, without, rtol=0, atol=0)
