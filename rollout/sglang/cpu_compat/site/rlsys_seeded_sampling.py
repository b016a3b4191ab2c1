"""Per-request sampling seeds on a CPU server (docs/notes/per-request-seeds.md).

rlsys gives every sample its own `sampling_seed` (rollout/seeds.py), so that what a sample draws
depends on its seed and its token positions only: not on the engine it went to, on its batch-mates,
or on what the engine drew before (a resumed run and a restarted engine then sample as the
uninterrupted run did). SGLang 0.5.23 samples with a request's seed only under
`--enable-deterministic-inference`, which refuses the CPU's torch_native attention, and its seeded
draw hashes through a compiled sgl_kernel op that CPU installs lack. Three replacements make it work:

1. `SamplingBatchInfo.from_schedule_batch` always builds the batch's seed tensor. A request that
   brought no seed gets one drawn from the server's global generator when it is first scheduled
   (kept on the request, so its decode steps go on with it): such requests sample as randomly as
   before, and `--random-seed` / rlsys's restart of the engine's random stream still fix them.
2. `multinomial_with_seed` (SGLang's Gumbel-max draw) with MurmurHash3 in plain torch integer
   arithmetic, bit for bit SGLang's Triton `murmur_hash32_kernel` (sglang/kernels/ops/sampling/
   murmur_hash.py): the noise of (seed, position, token id). Rows go in chunks, so that a large
   vocabulary does not hold a [batch, vocab] float64 tensor per temporary.
3. The top-k/top-p/min-p path's seeded draw indexes the noise by token id, as the plain path does,
   instead of by the token's rank after sorting: which path a batch takes depends on every request
   in it (`need_top_p_sampling` is an `any`), so rank-indexed noise would make one request's tokens
   depend on its batch-mates (a greedy eval request sets top_k=1). min_p then works with a seed too.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_C1, _C2, _M, _N = 0xCC9E2D51, 0x1B873593, 5, 0xE6546B64
_FMIX1, _FMIX2 = 0x85EBCA6B, 0xC2B2AE35
_UINT32_MAX = float(_MASK32)
# Elements of one chunk of rows x vocabulary (int64 and float64 temporaries: ~32 MiB each).
_CHUNK_ELEMENTS = 1 << 22
# Seeds drawn for requests that brought none: [0, 2**63), as SGLang's SamplingParams accepts.
_SEED_HIGH = 2**63 - 1


def _mul32(value: torch.Tensor, constant: int) -> torch.Tensor:
    """(value * constant) mod 2**32 for int64 values in [0, 2**32), in 16-bit halves so that no
    product leaves int64 (low half * constant < 2**48; the high half's product is shifted in)."""
    return ((value & 0xFFFF) * constant + (((value >> 16) * (constant & 0xFFFF)) << 16)) & _MASK32


def _rotl32(value: torch.Tensor, bits: int) -> torch.Tensor:
    return ((value << bits) | (value >> (32 - bits))) & _MASK32


def _mixed_key(key: torch.Tensor) -> torch.Tensor:
    return _mul32(_rotl32(_mul32(key, _C1), 15), _C2)


def _mix(state: torch.Tensor, mixed_key: torch.Tensor) -> torch.Tensor:
    state = _rotl32(state ^ mixed_key, 13)
    return (_mul32(state, _M) + _N) & _MASK32


def _fmix32(state: torch.Tensor) -> torch.Tensor:
    state = state ^ (state >> 16)
    state = _mul32(state, _FMIX1)
    state = state ^ (state >> 13)
    state = _mul32(state, _FMIX2)
    return state ^ (state >> 16)


def murmur_hash32(seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor) -> torch.Tensor:
    """SGLang's `murmur_hash32(seed [n], positions [n], col_indices [m])` -> [n, m] hashes (as int64
    holding uint32 values): the seed's low then high 32 bits, the position, the column, then the
    length (16 bytes) and the final mix."""
    seed = seed.to(torch.int64)
    state = torch.zeros_like(seed)
    state = _mix(state, _mixed_key(seed & _MASK32))
    state = _mix(state, _mixed_key((seed >> 32) & _MASK32))
    state = _mix(state, _mixed_key(positions.to(torch.int64) & _MASK32))
    columns = _mixed_key(col_indices.to(torch.int64) & _MASK32)
    hashed = _mix(state.view(-1, 1), columns.view(1, -1))
    return _fmix32(hashed ^ 16)


def multinomial_with_seed(logprobs: torch.Tensor, seed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """SGLang's `multinomial_with_seed`: argmax(logprobs + Gumbel noise of (seed, position, column)),
    the noise in float64 and clamped as SGLang clamps it; [n, 1] column indices."""
    rows, columns = logprobs.shape
    col_indices = torch.arange(columns, device=logprobs.device)
    chunk = max(1, _CHUNK_ELEMENTS // max(columns, 1))
    picked = []
    for start in range(0, rows, chunk):
        stop = min(rows, start + chunk)
        noise = murmur_hash32(seed[start:stop], positions[start:stop], col_indices).to(torch.float64) / _UINT32_MAX
        noise.log_().clamp_(min=torch.finfo(torch.float64).min, max=-(2.0**-32)).neg_()
        noise.log_().neg_()
        noise.add_(logprobs[start:stop].to(torch.float64))
        picked.append(torch.argmax(noise, dim=1, keepdim=True))
    return torch.cat(picked) if picked else torch.empty((0, 1), dtype=torch.int64, device=logprobs.device)


def seeded_filtered_sampling(original):
    """`top_k_top_p_min_p_sampling_from_probs_torch`, whose seeded draw indexes the noise by token
    id (3); without a seed, or when SGLang asks for the filtered probabilities too (a sampling-mask
    capture, which rlsys never asks for), SGLang's own."""

    def top_k_top_p_min_p_sampling_from_probs_torch(probs, top_ks, top_ps, min_ps, need_min_p_sampling,
                                                    sampling_seed, positions, *,
                                                    return_filtered_probs=False, max_top_k=None):
        if sampling_seed is None or return_filtered_probs:
            return original(probs, top_ks, top_ps, min_ps, need_min_p_sampling, sampling_seed, positions,
                            return_filtered_probs=return_filtered_probs, max_top_k=max_top_k)
        probs_sort, probs_idx = probs.sort(dim=-1, descending=True)
        probs_sum = torch.cumsum(probs_sort, dim=-1)
        ranks = torch.arange(probs_sort.shape[-1], device=probs.device).view(1, -1)
        probs_sort[ranks >= top_ks.view(-1, 1)] = 0.0
        probs_sort[(probs_sum - probs_sort) > top_ps.view(-1, 1)] = 0.0
        if need_min_p_sampling:
            probs_sort[probs_sort < (probs_sort[:, 0] * min_ps).view(-1, 1)] = 0.0
        filtered = torch.zeros_like(probs).scatter_(1, probs_idx, probs_sort)
        picked = multinomial_with_seed(filtered.to(torch.float64).log_(), sampling_seed, positions)
        return picked.view(-1).to(torch.int32)

    return top_k_top_p_min_p_sampling_from_probs_torch


def always_seeded(original):
    """`SamplingBatchInfo.from_schedule_batch` (a classmethod: `original` is its function) that
    always builds the seed tensor (1)."""

    def from_schedule_batch(cls, batch, vocab_size):
        for request in batch.reqs:
            if request.sampling_params.sampling_seed is None:
                request.sampling_params.sampling_seed = int(torch.randint(0, _SEED_HIGH, (1,)).item())
        info = original(cls, batch, vocab_size)
        if info.sampling_seed is None:
            info.sampling_seed = torch.tensor([r.sampling_params.sampling_seed for r in batch.reqs],
                                              dtype=torch.int64).to(batch.device)
        return info

    return from_schedule_batch
