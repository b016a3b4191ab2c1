"""Ring and Ulysses attention over real gloo CP groups against exact causal attention of whole
sequences, forward and backward, and the zigzag layout's own rules.

Bound: every output element is a softmax-weighted sum of at most L values, computed by the CP
side in blocks merged by log-sum-exp and by the reference in one pass, both in fp32 (unit
roundoff u = 2^-24 ~ 6e-8): the two orders differ by at most ~2 L u |v|max (the merge's
exponentials add a few u relative), and the gradients, sums of at most L products of such values,
by ~4 L u of their scale. With L <= 40 and O(1) inputs: 1e-5 absolute, ~100x the arithmetic's
worst case and ~1e4 x below what a wrong mask or a misplaced chunk moves (O(0.1), see the
mutation test).
"""

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlsys.actors.cp_layout import (
    ContextParallelGroup,
    build_layout,
    check_ulysses_heads,
    padded_length,
    zigzag_positions,
)
from tests.helpers import join_gloo_group, meeting_queue

ATOL = 1e-5
LENGTHS = [7, 12, 1, 20]  # odd lengths: padded to a multiple of 2 x CP
HEADS, KV_HEADS, DIM = 4, 2, 8


def _inputs(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    total = sum(LENGTHS)
    q = torch.randn(HEADS, total, DIM, generator=generator)
    k = torch.randn(KV_HEADS, total, DIM, generator=generator)
    v = torch.randn(KV_HEADS, total, DIM, generator=generator)
    grad = torch.randn(HEADS, total, DIM, generator=generator)
    return q, k, v, grad


def _reference(q, k, v, grad):
    """Causal attention of each whole sequence (SDPA), with its gradients."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    outputs, start = [], 0
    for length in LENGTHS:
        s = slice(start, start + length)
        outputs.append(torch.nn.functional.scaled_dot_product_attention(
            q[None, :, s], k[None, :, s], v[None, :, s], is_causal=True, enable_gqa=True)[0])
        start += length
    out = torch.cat(outputs, dim=1)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def _local(full: torch.Tensor, sources: torch.Tensor) -> torch.Tensor:
    """[H, T, D] unsplit -> [H, T_local, D] of one CP rank (zeros at padding)."""
    real = sources >= 0
    local = full.new_zeros(full.shape[0], len(sources), full.shape[2])
    local[:, real] = full[:, sources[real]]
    return local


def _rank(rank: int, size: int, queue, style: str, swap_chunks: bool, results):
    join_gloo_group(rank, size, queue)
    try:
        from rlsys.actors import context_parallel, cp_layout

        if swap_chunks:  # a mutation: each rank's chunks in the wrong order (the second first)
            original = cp_layout.zigzag_positions

            def swapped(length, cp_size, cp_rank):
                positions = original(length, cp_size, cp_rank)
                half = len(positions) // 2
                return positions[half:] + positions[:half]

            cp_layout.zigzag_positions = swapped
        cp = ContextParallelGroup(dist.new_group(list(range(size))), rank, size, style)
        layout = build_layout(LENGTHS, cp, torch.device("cpu"))
        q, k, v, grad = _inputs()
        local = [_local(t, layout.local_sources).requires_grad_() for t in (q, k, v)]
        out, _ = context_parallel.context_parallel_attention(
            None, *(t[None] for t in local), None, scaling=DIM**-0.5, context_parallel=layout)
        out = out[0].transpose(0, 1)  # [H, T_local, D]
        out.backward(_local(grad, layout.local_sources))
        results[rank] = {"sources": layout.local_sources, "out": out.detach(),
                         "dq": local[0].grad, "dk": local[1].grad, "dv": local[2].grad}
    finally:
        dist.destroy_process_group()


def _run(size: int, style: str, swap_chunks: bool = False) -> dict:
    manager = mp.get_context("spawn").Manager()
    results = manager.dict()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.start_processes(_rank, args=(size, meeting_queue(), style, swap_chunks, results), nprocs=size,
                       start_method="spawn")
    return {rank: {name: value.clone() for name, value in part.items()} for rank, part in results.items()}


def _unsplit(results: dict, name: str, like: torch.Tensor) -> torch.Tensor:
    """Each real token's value from the rank that holds it (keys and values: the sum over ranks of
    a token's gradient lands on its owner)."""
    full = torch.zeros_like(like)
    for part in results.values():
        real = part["sources"] >= 0
        full[:, part["sources"][real]] = part[name][:, real]
    return full


@pytest.mark.parametrize(("size", "style"), [(2, "ring"), (4, "ring"), (2, "ulysses")])
def test_context_parallel_attention_equals_whole_sequence_attention(size, style):
    expected = _reference(*_inputs())
    results = _run(size, style)
    for name, reference in zip(("out", "dq", "dk", "dv"), expected, strict=True):
        got = _unsplit(results, name, reference)
        assert torch.allclose(got, reference, atol=ATOL, rtol=0), (name, (got - reference).abs().max())


def test_a_wrong_zigzag_order_is_caught():
    expected = _reference(*_inputs())
    got = _unsplit(_run(2, "ring", swap_chunks=True), "out", expected[0])
    assert (got - expected[0]).abs().max() > 100 * ATOL


def test_zigzag_gives_rank_r_chunks_r_and_2cp_minus_1_minus_r():
    assert padded_length(7, 2) == 8 and padded_length(8, 2) == 8 and padded_length(1, 4) == 8
    assert zigzag_positions(7, 2, 0) == [0, 1, 6, 7]
    assert zigzag_positions(7, 2, 1) == [2, 3, 4, 5]
    covered = sorted(p for rank in range(4) for p in zigzag_positions(20, 4, rank))
    assert covered == list(range(padded_length(20, 4)))


def test_every_rank_has_the_same_causal_work():
    """Zigzag's point: the pairs (query, visible key) per rank are equal (within one chunk's)."""
    length, size = 32, 4
    work = [sum(p + 1 for p in zigzag_positions(length, size, rank)) for rank in range(size)]
    assert max(work) - min(work) == 0


def test_layout_marks_padding_and_keeps_each_tokens_row_index():
    cp = ContextParallelGroup(None, 1, 2, "ring")
    layout = build_layout([3, 5], cp, torch.device("cpu"))
    # sequence 0 (row 0..2) padded to 4, sequence 1 (row 3..7) to 8; rank 0 holds positions 0, 3 and
    # 0, 1, 6, 7, rank 1 positions 1, 2 and 2, 3, 4, 5; positions past a sequence's end are padding
    assert layout.sources[0].tolist() == [0, -1, 3 + 0, 3 + 1, -1, -1]
    assert layout.sources[1].tolist() == [1, 2, 3 + 2, 3 + 3, 3 + 4, -1]


def test_ulysses_refuses_heads_that_do_not_divide():
    check_ulysses_heads(8, 4, 4)
    with pytest.raises(ValueError, match="2 key/value heads must both divide by context_parallel_size=4"):
        check_ulysses_heads(8, 2, 4)
    assert math.gcd(HEADS, KV_HEADS) == KV_HEADS  # the test model's heads allow CP 2 for Ulysses


@pytest.mark.parametrize("size", [2, 3, 4])
def test_each_cp_rank_scores_its_own_tokens_with_the_whole_sequences_labels(size):
    """A rank's micro-batch: every real token at its own position, labelled with the token that
    follows it in the whole sequence (at a chunk's end: the next chunk's first token, held by another
    rank), carrying that position's loss values; padding weighs nothing; every scored token of the
    unsplit batch is scored by exactly one rank."""
    from rlsys.actors.batching import build_micro_batch
    from rlsys.actors.context_parallel import shard_micro_batch
    from rlsys.records import TrainSequence

    generator = torch.Generator().manual_seed(5)
    sequences = [TrainSequence(torch.randint(3, 90, (n,), generator=generator).tolist(), prompt_len=p,
                               advantage=float(i) + 0.5, engine_logprobs=[-0.1 * j for j in range(n - p)])
                 for i, (n, p) in enumerate([(9, 3), (14, 1), (2, 1), (23, 8)])]
    whole = build_micro_batch(sequences, list(range(4)), 0, torch.device("cpu"), packed=True)
    scored = torch.zeros_like(whole.loss_weights)
    for rank in range(size):
        part = shard_micro_batch(whole, ContextParallelGroup(None, rank, size))
        sources = part.context_parallel.local_sources
        for at, source in enumerate(sources.tolist()):
            if source < 0:  # padding: no loss, no engine log-prob
                assert part.loss_weights[0, at] == 0 and part.engine_mask[0, at] == 0
                continue
            assert part.input_ids[0, at] == whole.input_ids[0, source]
            if source < whole.targets.shape[1]:
                assert part.targets[0, at] == whole.input_ids[0, source + 1]
                for name in ("loss_weights", "advantages", "engine_logprobs", "engine_mask", "response_mask"):
                    assert getattr(part, name)[0, at] == getattr(whole, name)[0, source], name
                scored[0, source] += part.response_mask[0, at]
        start = 0
        for n in [len(s.token_ids) for s in sequences]:  # positions restart per sequence, zigzag
            mine = zigzag_positions(n, size, rank)
            assert part.position_ids[0, start:start + len(mine)].tolist() == mine
            start += len(mine)
    assert torch.equal(scored, whole.response_mask)


@pytest.mark.parametrize("causal", [True, False])
def test_the_block_function_gives_the_same_in_pieces_of_any_size(monkeypatch, causal):
    """The exact block function (the GPU's; the CPU takes torch's flash kernel, checked equal here)
    bounds its fp32 scores by taking heads and then query rows in pieces (ring_attention.SCORE_BUDGET_BYTES):
    any piece size computes the same values (each query row's softmax is its own), forward and backward."""
    from rlsys.actors import ring_attention
    from rlsys.actors.ring_attention import Segments, attend_block, exact_attend_block, exact_attend_block_backward

    q, k, v, grad = _inputs(7)
    q_lengths, kv_lengths = ((7, 12, 1, 20), (7, 12, 1, 20)) if causal else ((7, 12, 1, 20), (3, 12, 9, 16))
    k, v = k[:, :sum(kv_lengths)], v[:, :sum(kv_lengths)]
    everything = (torch.arange(sum(q_lengths)), torch.arange(sum(kv_lengths)))
    segments = Segments(*everything, q_lengths, kv_lengths, causal=causal)

    def computed():
        out, lse = exact_attend_block(q, k, v, segments, 0.3)
        return (out, lse, *exact_attend_block_backward(grad, q, k, v, out, lse, segments, 0.3))

    whole = computed()
    flash = attend_block(q, k, v, segments, 0.3)  # on CPU: torch's flash kernel, the same values
    assert all(torch.allclose(a, b, atol=ATOL, rtol=0) for a, b in zip(flash, whole[:2], strict=True))
    for budget in (4 * 20 * 20 * 2, 4 * 20 * 3, 1):  # one KV group's whole block; a few rows; one row at a time
        monkeypatch.setattr(ring_attention, "SCORE_BUDGET_BYTES", budget)
        for expected, got in zip(whole, computed(), strict=True):
            assert torch.allclose(got, expected, atol=ATOL, rtol=0)  # sums over rows in other orders
    assert ring_attention.score_chunks(HEADS, HEADS // KV_HEADS, 20, 20) == (2, 1)  # budget 1: one group, one row
    monkeypatch.setattr(ring_attention, "SCORE_BUDGET_BYTES", 4 * 20 * 7 * 2)
    assert ring_attention.score_chunks(HEADS, HEADS // KV_HEADS, 20, 20) == (2, 7)  # one group, 7 rows


def _flash_stand_ins(calls: list):
    """CPU stand-ins with the contract of torch's CUDA varlen flash ops (the GPU's block kernel):
    [T, H, D] rows, int32 cumulative lengths, lse [H, Tq] fp32, a backward that takes the output and
    log-sum-exp it is given. Exact math, per sequence."""

    def spans(cu):
        bounds = cu.tolist()
        return list(zip(bounds[:-1], bounds[1:], strict=True))

    def scores(q, k, scale, causal):
        s = torch.einsum("qhd,khd->hqk", q, k) * scale
        if causal:
            s = s.masked_fill(torch.ones(s.shape[1:], dtype=torch.bool).triu(1 + s.shape[2] - s.shape[1]), -math.inf)
        return s

    def forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, debug, *, scale):
        assert cu_q.dtype == cu_k.dtype == torch.int32 and q.shape[1] == k.shape[1] and dropout_p == 0.0
        assert max_q == max(b - a for a, b in spans(cu_q)) and max_k == max(b - a for a, b in spans(cu_k))
        calls.append(("forward", causal, len(cu_q) - 1))
        out, lse = torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0])
        for (qa, qb), (ka, kb) in zip(spans(cu_q), spans(cu_k), strict=True):
            s = scores(q[qa:qb], k[ka:kb], scale, causal)
            lse[:, qa:qb] = torch.logsumexp(s, -1)
            out[qa:qb] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v[ka:kb])
        return out, lse, torch.zeros(2, dtype=torch.uint64), torch.empty(0), torch.empty(0)

    def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, causal, rng_state, unused, *, scale):
        assert rng_state.dtype == torch.uint64 and lse.shape == (q.shape[1], q.shape[0])
        calls.append(("backward", causal, len(cu_q) - 1))
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for (qa, qb), (ka, kb) in zip(spans(cu_q), spans(cu_k), strict=True):
            p = torch.exp(scores(q[qa:qb], k[ka:kb], scale, causal) - lse[:, qa:qb, None])
            delta = (dout[qa:qb] * out[qa:qb]).sum(-1).T  # [H, q]
            dv[ka:kb] = torch.einsum("hqk,qhd->khd", p, dout[qa:qb])
            ds = p * (torch.einsum("qhd,khd->hqk", dout[qa:qb], v[ka:kb]) - delta[..., None])
            dq[qa:qb] = torch.einsum("hqk,khd->qhd", ds, k[ka:kb]) * scale
            dk[ka:kb] = torch.einsum("hqk,qhd->khd", ds, q[qa:qb]) * scale
        return dq, dk, dv

    return forward, backward


@pytest.mark.parametrize("causal", [True, False])
def test_the_gpu_block_kernel_equals_the_exact_block(monkeypatch, causal):
    """The CUDA path (one varlen flash call per block, rlsys's layout around it: rows gathered,
    key/value heads repeated and their gradients folded back, sequences without keys or queries
    left out, the final output and log-sum-exp handed to backward) equals the exact block, with the
    kernel's contract played by a CPU stand-in (torch's CUDA flash ops have no CPU implementation;
    the GPU proof kit's ring_attention check runs the real ones)."""
    from rlsys.actors import ring_attention
    from rlsys.actors.ring_attention import (
        Segments,
        attend_block,
        attend_block_backward,
        exact_attend_block,
        exact_attend_block_backward,
    )

    q, k, v, grad = _inputs(11)
    # non-causal: a sequence with keys but no queries here, and one with queries but no keys
    q_lengths, kv_lengths = ((7, 12, 1, 20), (7, 12, 1, 20)) if causal else ((7, 0, 12, 20), (3, 5, 0, 16))
    q, grad = q[:, :sum(q_lengths)], grad[:, :sum(q_lengths)]
    k, v = k[:, :sum(kv_lengths)], v[:, :sum(kv_lengths)]
    segments = Segments(torch.arange(sum(q_lengths)), torch.arange(sum(kv_lengths)), q_lengths, kv_lengths,
                        causal=causal)
    out, lse = exact_attend_block(q, k, v, segments, 0.3)
    expected = (out, lse, *exact_attend_block_backward(grad, q, k, v, out, lse, segments, 0.3))

    calls = []
    forward, backward = _flash_stand_ins(calls)
    monkeypatch.setattr(ring_attention, "block_kernel", lambda q: "flash_cuda")
    monkeypatch.setattr(ring_attention, "flash_forward_op", lambda: forward)
    monkeypatch.setattr(ring_attention, "flash_backward_op", lambda: backward)
    got_out, got_lse = attend_block(q, k, v, segments, 0.3)
    got = (got_out, got_lse, *attend_block_backward(grad, q, k, v, got_out, got_lse, segments, 0.3))
    active = sum(1 for a, b in zip(q_lengths, kv_lengths, strict=True) if a and b)
    assert calls == [("forward", causal, active), ("backward", causal, active)]  # one call each for the block
    # the rows and lengths are built once for the segments, then serve every layer's forward and backward
    assert ring_attention.VarlenRows.of(segments, q.device) is ring_attention.VarlenRows.of(segments, q.device)
    assert list(segments.varlen_cache) == [str(q.device)]
    for name, want, have in zip(("out", "lse", "dq", "dk", "dv"), expected, got, strict=True):
        assert torch.allclose(have, want, atol=ATOL, rtol=0), name
    if not causal:  # the queries with no keys in this block: nothing attended, as the exact block says
        no_keys = slice(7, 7 + 12)
        assert torch.all(got_lse[:, no_keys] == -math.inf) and torch.all(got_out[:, no_keys] == 0)


def test_the_block_kernel_is_flash_on_cpu_and_cuda_16_bit_else_exact(monkeypatch):
    from rlsys.actors import ring_attention

    assert ring_attention.block_kernel(torch.zeros(2, 3, 8)) == "flash_cpu"
    assert ring_attention.block_kernel(torch.zeros(2, 3, 8, device="meta")) == "exact"  # neither CPU nor CUDA
    monkeypatch.setattr(ring_attention, "cuda_flash_takes", lambda q: True)
    assert ring_attention.block_kernel(torch.zeros(2, 3, 8, device="meta")) == "flash_cuda"
