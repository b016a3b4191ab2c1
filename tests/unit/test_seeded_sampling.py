"""Per-request sampling seeds on a CPU server (rollout/sglang/cpu_compat/site/rlsys_seeded_sampling.py)
and the seeds rlsys gives its samples (rollout/seeds.py): a token depends on (seed, position) and the
probabilities only, not on the batch, and the draws follow the probabilities."""

import struct

import pytest
import torch

from rlsys.rollout.seeds import call_seed, derived_seed, eval_prompt_seed, sample_seeds, train_prompt_seed
from rlsys.rollout.sglang.cpu_compat.site import rlsys_seeded_sampling as seeded

TOP_K_ALL = 1 << 30  # what SGLang turns top_k=-1 into


def _murmur3_x86_32(data: bytes, seed: int = 0) -> int:
    """MurmurHash3_x86_32 as its reference (Austin Appleby's) defines it, on whole 4-byte blocks."""
    c1, c2, h = 0xCC9E2D51, 0x1B873593, seed
    for (k,) in struct.iter_unpack("<I", data):
        k = (k * c1) & 0xFFFFFFFF
        k = ((k << 15) | (k >> 17)) & 0xFFFFFFFF
        k = (k * c2) & 0xFFFFFFFF
        h ^= k
        h = ((h << 13) | (h >> 19)) & 0xFFFFFFFF
        h = (h * 5 + 0xE6546B64) & 0xFFFFFFFF
    h ^= len(data)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def test_the_hash_is_murmur3_of_seed_position_and_token_as_sglang_blends_them():
    seeds = torch.tensor([0, 1, 42, 2**31 + 7, 2**62 + 12345, 2**63 - 1])
    positions = torch.tensor([0, 3, 17, 100_000, 2**31 - 1, 5])
    columns = torch.tensor([0, 1, 2, 151_935, 2**31 - 1])
    got = seeded.murmur_hash32(seeds, positions, columns)
    for row, (seed, position) in enumerate(zip(seeds.tolist(), positions.tolist(), strict=True)):
        for col, column in enumerate(columns.tolist()):
            data = struct.pack("<IIII", seed & 0xFFFFFFFF, seed >> 32, position, column)
            assert got[row, col].item() == _murmur3_x86_32(data), (seed, position, column)


def _probs(rows: int, vocab: int, generator_seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(generator_seed)
    return torch.softmax(torch.randn(rows, vocab, generator=generator) * 2, dim=-1)


def test_a_seeded_draw_is_the_same_alone_and_in_any_batch():
    probs = _probs(6, 50, 0)
    seeds, positions = torch.tensor([7, 8, 9, 10, 11, 12]), torch.tensor([4, 4, 9, 1, 30, 2])
    together = seeded.multinomial_with_seed(probs.log(), seeds, positions).view(-1)
    for row in range(6):
        alone = seeded.multinomial_with_seed(probs[row:row + 1].log(), seeds[row:row + 1], positions[row:row + 1])
        assert alone.item() == together[row].item()
    reordered = seeded.multinomial_with_seed(probs.flip(0).log(), seeds.flip(0), positions.flip(0)).view(-1)
    assert reordered.flip(0).tolist() == together.tolist()
    # another seed or another position: another draw (of 50 tokens, not the same in all 6 rows)
    assert seeded.multinomial_with_seed(probs.log(), seeds + 1, positions).view(-1).tolist() != together.tolist()
    assert seeded.multinomial_with_seed(probs.log(), seeds, positions + 1).view(-1).tolist() != together.tolist()


def test_seeded_draws_follow_the_probabilities():
    """20,000 seeds of one distribution: each token's count within 5 binomial standard deviations of
    its expectation (the hash is fixed, so this is one fixed sample, not a chance to fail)."""
    draws = 20_000
    probs = torch.tensor([[0.5, 0.25, 0.15, 0.07, 0.03]], dtype=torch.float64)
    picked = seeded.multinomial_with_seed(probs.log().expand(draws, -1), torch.arange(draws) * 7919 + 3,
                                          torch.full((draws,), 11)).view(-1)
    counts = torch.bincount(picked, minlength=5).double()
    expected = probs[0] * draws
    assert ((counts - expected).abs() <= 5 * (expected * (1 - probs[0])).sqrt()).all(), counts.tolist()


def test_large_batches_go_in_chunks_with_the_same_draws(monkeypatch):
    probs = _probs(9, 64, 1)
    seeds, positions = torch.arange(9) * 3 + 1, torch.arange(9)
    whole = seeded.multinomial_with_seed(probs.log(), seeds, positions)
    monkeypatch.setattr(seeded, "_CHUNK_ELEMENTS", 2 * 64)  # two rows a chunk
    assert seeded.multinomial_with_seed(probs.log(), seeds, positions).tolist() == whole.tolist()


def test_the_filtered_path_indexes_the_noise_by_token_so_a_batch_mates_top_k_changes_nothing():
    """A greedy request (SGLang: top_k=1) sends the whole batch down the top-k/top-p path; a request
    without filtering then draws what it draws alone on the plain path."""
    filtered = seeded.seeded_filtered_sampling(original=None)
    probs = _probs(3, 40, 2)
    seeds, positions = torch.tensor([5, 6, 7]), torch.tensor([2, 8, 3])
    plain = seeded.multinomial_with_seed(probs.log(), seeds, positions).view(-1)
    top_ks = torch.tensor([TOP_K_ALL, 1, TOP_K_ALL])
    got = filtered(probs.clone(), top_ks, torch.ones(3), torch.zeros(3), False, seeds, positions)
    assert got[0].item() == plain[0].item() and got[2].item() == plain[2].item()
    assert got[1].item() == probs[1].argmax().item()  # top_k=1 is greedy


def test_top_p_and_min_p_keep_the_draw_inside_what_they_allow():
    filtered = seeded.seeded_filtered_sampling(original=None)
    probs = torch.tensor([[0.6, 0.3, 0.06, 0.04]]).expand(500, -1).contiguous()
    seeds, positions = torch.arange(500) + 1, torch.zeros(500, dtype=torch.int64)
    nucleus = filtered(probs.clone(), torch.full((500,), TOP_K_ALL), torch.full((500,), 0.8), torch.zeros(500),
                       False, seeds, positions)
    assert set(nucleus.tolist()) == {0, 1}  # 0.6 + 0.3 covers 0.8; both are drawn among 500
    above = filtered(probs.clone(), torch.full((500,), TOP_K_ALL), torch.ones(500), torch.full((500,), 0.2),
                     True, seeds, positions)
    assert set(above.tolist()) == {0, 1}  # min_p 0.2 of 0.6: 0.12, so 0.06 and 0.04 are out


def test_without_a_seed_the_filtered_path_is_sglangs_own():
    calls = []
    filtered = seeded.seeded_filtered_sampling(lambda *args, **kwargs: calls.append((args, kwargs)) or "sglang's")
    assert filtered(torch.ones(1, 3), torch.ones(1), torch.ones(1), torch.zeros(1), False, None, None) == "sglang's"
    assert calls and calls[0][1] == {"return_filtered_probs": False, "max_top_k": None}


def test_rlsys_seeds_are_stable_distinct_and_in_sglangs_range():
    assert derived_seed("train", 0, 1, 2) == derived_seed("train", 0, 1, 2)  # the same in every process
    assert derived_seed("train", 0, 1, 2) == 6255293836384828940  # and in every release: a changed rule shows here
    seeds = {train_prompt_seed(0, epoch, index) for epoch in range(3) for index in range(200)}
    seeds |= {eval_prompt_seed(0, name, number) for name in (None, "math") for number in range(200)}
    assert len(seeds) == 3 * 200 + 2 * 200
    assert all(0 <= seed < 2**63 for seed in seeds)
    assert train_prompt_seed(0, 0, 5) != train_prompt_seed(1, 0, 5)  # the run's seed counts
    group = sample_seeds(123, 8)
    assert len(set(group)) == 8 and sample_seeds(None, 3) == [None, None, None]
    assert call_seed(group[0], 0) != call_seed(group[0], 1) and call_seed(None, 4) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_draw_is_one_token_per_row_of_the_vocabulary(dtype):
    probs = _probs(4, 10, 3).to(dtype)
    picked = seeded.multinomial_with_seed(probs.log(), torch.arange(4), torch.arange(4))
    assert picked.shape == (4, 1) and picked.dtype == torch.int64 and ((0 <= picked) & (picked < 10)).all()
