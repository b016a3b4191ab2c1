"""Ring attention over a context-parallel group, with the sequences split zigzag.

Each CP rank holds, of every sequence of a packed micro-batch (padded to a multiple of 2 x CP),
chunks r and 2CP-1-r of 2 x CP (`actors/context_parallel.py`). It keeps its queries; the key/value
chunks travel around the ring, one hop per step, and each step's partial output is merged into the
running one by log-sum-exp. Zigzag makes every step the same amount of causal work:

| step (key/values of rank s) | queries            | keys/values        | mask   |
|-----------------------------|--------------------|--------------------|--------|
| 0 (s = r, its own)          | both chunks        | both chunks        | causal |
| s < r                       | both chunks        | s's first chunk    | none   |
| s > r                       | the second chunk   | both of s's chunks | none   |

(chunk s < CP <= 2CP-1-s: an earlier rank's first chunk precedes both of this rank's; a later
rank's chunks both precede this rank's second chunk and follow its first.)

Backward recomputes each block from the saved queries, keys, values, output and log-sum-exp
(flash attention's scheme); the key/value gradients travel around the ring with their key/values
and reach their owner one hop after the last step. Communication is point-to-point
(`dist.isend`/`irecv` within the CP group: NCCL on GPU, gloo on CPU), overlapped with the block's
computation. The block function (`attend_block`, `attend_block_backward`) returns the block's
log-sum-exp and takes the final one in backward (`block_kernel` chooses):
- CPU: torch's own flash kernels (`_scaled_dot_product_flash_attention_for_cpu` and its backward:
  blocked, no score matrix kept), one call per sequence;
- CUDA, 16-bit, sm80+: torch's varlen flash kernels (`aten._flash_attention_forward` and
  `_flash_attention_backward`, what `torch.nn.attention.varlen` calls), one call for the block's
  sequences; the backward takes the final output and log-sum-exp as the CPU one does;
- anything else (fp32 on a GPU, an older GPU, a head dimension flash lacks): exact fp32 attention in
  pieces whose scores stay within SCORE_BUDGET_BYTES, the checked fallback the others equal.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from rlsys.system.backend import cuda_flash_takes

# Transient bytes of one block's fp32 score matrix, over which heads are taken in chunks.
SCORE_BUDGET_BYTES = 256 * 2**20


@dataclass(frozen=True)
class Segments:
    """One step's varlen layout: per sequence, its queries' and keys' lengths, and where they sit
    in the local row (index tensors into the query and key/value rows)."""

    q_index: torch.Tensor  # [Tq] positions in the local query row
    kv_index: torch.Tensor  # [Tk] positions in the (received) key/value row
    q_lengths: tuple[int, ...]
    kv_lengths: tuple[int, ...]
    causal: bool
    # The varlen kernel's rows and cumulative lengths, by device, built at the first call (`VarlenRows.of`):
    # a micro-batch's segments serve every layer's forward and backward.
    varlen_cache: dict = field(default_factory=dict, compare=False, repr=False)


def _repeat_kv(states: torch.Tensor, groups: int) -> torch.Tensor:
    return states if groups == 1 else states.repeat_interleave(groups, dim=0)


def _fold_kv(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of `_repeat_kv`: each KV head's query heads' gradients summed."""
    return grad if groups == 1 else grad.unflatten(0, (-1, groups)).sum(1)


def score_chunks(heads: int, groups: int, q_len: int, kv_len: int) -> tuple[int, int]:
    """(query heads, query rows) per piece of a block, so one piece's fp32 scores stay within
    SCORE_BUDGET_BYTES: whole key/value groups of heads while a group's full rows fit, else one
    group over as many query rows as fit (at least one row)."""
    row_bytes = 4 * kv_len
    heads_that_fit = SCORE_BUDGET_BYTES // max(1, row_bytes * q_len)
    if heads_that_fit >= groups:
        return min(heads, heads_that_fit // groups * groups), q_len
    return groups, max(1, min(q_len, SCORE_BUDGET_BYTES // max(1, row_bytes * groups)))


def _pieces(segments: Segments, heads: int, groups: int):
    """Each piece of a block: (query heads, key/value heads, query rows, key/value columns, the
    rows' causal offset), sequence by sequence."""
    q_start = kv_start = 0
    for q_len, kv_len in zip(segments.q_lengths, segments.kv_lengths, strict=True):
        if q_len and kv_len:
            step, rows = score_chunks(heads, groups, q_len, kv_len)
            for h in range(0, heads, step):
                for row in range(0, q_len, rows):
                    end = min(row + rows, q_len)
                    yield (slice(h, h + step), slice(h // groups, (h + step) // groups),
                           slice(q_start + row, q_start + end), slice(kv_start, kv_start + kv_len),
                           (row, end, q_len, kv_len))
        q_start, kv_start = q_start + q_len, kv_start + kv_len


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool, rows: tuple[int, int, int, int]):
    scores = torch.matmul(q.float(), k.float().transpose(1, 2)) * scale
    return scores + _causal_bias(*rows, q.device) if causal else scores


def exact_attend_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments, scale: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of each sequence's queries over its keys: q [Hq, Tq, D], k, v [Hkv, Tk, D]
    (already selected by the segments) -> out [Hq, Tq, D] fp32, lse [Hq, Tq] fp32.
    out = softmax(q k^T * scale) v, lse = log sum_j exp(q k_j^T * scale); causal aligns the ends."""
    groups = q.shape[0] // k.shape[0]
    out = q.new_zeros(q.shape, dtype=torch.float32)
    lse = q.new_full(q.shape[:2], -math.inf, dtype=torch.float32)
    for hs, kvh, qs, ks, rows in _pieces(segments, q.shape[0], groups):
        scores = _scores(q[hs, qs], _repeat_kv(k[kvh, ks], groups), scale, segments.causal, rows)
        block_lse = torch.logsumexp(scores, dim=-1)
        lse[hs, qs] = block_lse
        out[hs, qs] = torch.matmul(torch.exp(scores - block_lse[..., None]), _repeat_kv(v[kvh, ks], groups).float())
    return out, lse


def exact_attend_block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                out: torch.Tensor, lse: torch.Tensor, segments: Segments, scale: float
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the FINAL output and log-sum-exp of the queries (flash
    attention's backward): p = exp(s - lse), dv = p^T dO, ds = p (dO v^T - rowsum(dO * O)),
    dq = ds k * scale, dk = ds^T q * scale. All fp32."""
    groups = q.shape[0] // k.shape[0]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    delta = (dout.float() * out.float()).sum(-1)  # [Hq, Tq]
    for hs, kvh, qs, ks, rows in _pieces(segments, q.shape[0], groups):
        qh, kh = q[hs, qs].float(), _repeat_kv(k[kvh, ks], groups).float()
        vh, doh = _repeat_kv(v[kvh, ks], groups).float(), dout[hs, qs].float()
        p = torch.exp(_scores(qh, kh, scale, segments.causal, rows) - lse[hs, qs, None])
        dv[kvh, ks] += _fold_kv(torch.matmul(p.transpose(1, 2), doh), groups)
        ds = p * (torch.matmul(doh, vh.transpose(1, 2)) - delta[hs, qs, None])
        dq[hs, qs] += torch.matmul(ds, kh) * scale
        dk[kvh, ks] += _fold_kv(torch.matmul(ds.transpose(1, 2), qh) * scale, groups)
    return dq, dk, dv


def block_kernel(q: torch.Tensor) -> str:
    """Which kernel computes a block of these queries: "flash_cpu", "flash_cuda" or "exact"."""
    if q.device.type == "cpu":
        return "flash_cpu"
    if cuda_flash_takes(q):
        return "flash_cuda"
    return "exact"


def attend_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments, scale: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention -> (out, lse) fp32, as `exact_attend_block` defines it, by the kernel
    `block_kernel` chooses."""
    kernel = block_kernel(q)
    if kernel == "flash_cuda":
        return varlen_flash_block(q, k, v, segments, scale)
    if kernel == "exact":
        return exact_attend_block(q, k, v, segments, scale)
    groups = q.shape[0] // k.shape[0]
    out = q.new_zeros(q.shape, dtype=torch.float32)
    lse = q.new_full(q.shape[:2], -math.inf, dtype=torch.float32)
    for qs, ks in _segment_slices(segments):
        piece_out, piece_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[None, :, qs].float(), _repeat_kv(k[:, ks], groups)[None].float(),
            _repeat_kv(v[:, ks], groups)[None].float(), 0.0, segments.causal, attn_mask=None, scale=scale)
        out[:, qs], lse[:, qs] = piece_out[0], piece_lse[0]
    return out, lse


def attend_block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          lse: torch.Tensor, segments: Segments, scale: float
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`exact_attend_block_backward`'s gradients, by the kernel `block_kernel` chooses; the flash
    backward kernels take the output and log-sum-exp they are given (here the final ones: what the
    ring needs)."""
    kernel = block_kernel(q)
    if kernel == "flash_cuda":
        return varlen_flash_block_backward(dout, q, k, v, out, lse, segments, scale)
    if kernel == "exact":
        return exact_attend_block_backward(dout, q, k, v, out, lse, segments, scale)
    groups = q.shape[0] // k.shape[0]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    for qs, ks in _segment_slices(segments):
        piece_dq, piece_dk, piece_dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout[None, :, qs].float(), q[None, :, qs].float(), _repeat_kv(k[:, ks], groups)[None].float(),
            _repeat_kv(v[:, ks], groups)[None].float(), out[None, :, qs].contiguous(),
            lse[None, :, qs].contiguous(), 0.0, segments.causal, attn_mask=None, scale=scale)
        dq[:, qs] += piece_dq[0]
        dk[:, ks] += _fold_kv(piece_dk[0], groups)
        dv[:, ks] += _fold_kv(piece_dv[0], groups)
    return dq, dk, dv


@dataclass(frozen=True)
class VarlenRows:
    """The block's sequences that have both queries and keys, as one varlen call takes them: their
    rows in the block's query and key/value rows, and their cumulative lengths (int32)."""

    q_rows: torch.Tensor
    kv_rows: torch.Tensor
    cu_q: torch.Tensor
    cu_kv: torch.Tensor
    max_q: int
    max_kv: int

    @classmethod
    def of(cls, segments: Segments, device) -> VarlenRows | None:
        """The segments' rows on `device`, built once per segments and device (None: no sequence of
        the block has both queries and keys)."""
        key = str(device)
        if key not in segments.varlen_cache:
            segments.varlen_cache[key] = cls._built(segments, device)
        return segments.varlen_cache[key]

    @classmethod
    def _built(cls, segments: Segments, device) -> VarlenRows | None:
        q_rows, kv_rows, q_lengths, kv_lengths = [], [], [], []
        for qs, ks in _segment_slices(segments):
            q_rows.append(torch.arange(qs.start, qs.stop, device=device))
            kv_rows.append(torch.arange(ks.start, ks.stop, device=device))
            q_lengths.append(qs.stop - qs.start)
            kv_lengths.append(ks.stop - ks.start)
        if not q_rows:
            return None

        def cumulative(lengths: list[int]) -> torch.Tensor:
            return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)

        return cls(torch.cat(q_rows), torch.cat(kv_rows), cumulative(q_lengths), cumulative(kv_lengths),
                   max(q_lengths), max(kv_lengths))


def flash_forward_op():
    """torch's CUDA varlen flash forward: (q [Tq, H, D], k, v [Tk, H, D], cu_q, cu_k, max_q, max_k,
    dropout_p, is_causal, return_debug_mask, scale=) -> (out [Tq, H, D], lse [H, Tq] fp32, rng_state,
    unused, debug mask), as torch/nn/attention/varlen.py's `_varlen_attn` calls it."""
    return torch.ops.aten._flash_attention_forward


def flash_backward_op():
    """Its backward: (dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal,
    rng_state, unused, scale=) -> (dq, dk, dv), as `_varlen_attn_backward` calls it."""
    return torch.ops.aten._flash_attention_backward


def _varlen(states: torch.Tensor, rows: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """[H, T, D] -> the rows' [T', H * groups, D] (key/value heads repeated for their query heads)."""
    return _repeat_kv(states[:, rows], groups).transpose(0, 1).contiguous()


def varlen_flash_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments, scale: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend_block` by one varlen flash call over the block's sequences (q, k, v in their 16-bit
    dtype); queries of a sequence without keys here keep out 0 and lse -inf, as the exact block's."""
    groups = q.shape[0] // k.shape[0]
    out = q.new_zeros(q.shape, dtype=torch.float32)
    lse = q.new_full(q.shape[:2], -math.inf, dtype=torch.float32)
    rows = VarlenRows.of(segments, q.device)
    if rows is None:
        return out, lse
    piece_out, piece_lse, *_ = flash_forward_op()(
        _varlen(q, rows.q_rows), _varlen(k, rows.kv_rows, groups), _varlen(v, rows.kv_rows, groups),
        rows.cu_q, rows.cu_kv, rows.max_q, rows.max_kv, 0.0, segments.causal, False, scale=scale)
    out[:, rows.q_rows] = piece_out.transpose(0, 1).float()
    lse[:, rows.q_rows] = piece_lse.float()
    return out, lse


def varlen_flash_block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                out: torch.Tensor, lse: torch.Tensor, segments: Segments, scale: float
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`attend_block_backward` by one varlen flash backward call. The kernel takes the output in the
    inputs' dtype (flash attention's own output is 16-bit too) and the fp32 log-sum-exp; with no
    dropout its random state is never read (torch passes zeros, as here)."""
    groups = q.shape[0] // k.shape[0]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    rows = VarlenRows.of(segments, q.device)
    if rows is None:
        return dq, dk, dv
    rng_state = torch.zeros((2,), dtype=torch.uint64, device=q.device)
    unused = torch.empty(0, device=q.device)
    piece_dq, piece_dk, piece_dv = flash_backward_op()(
        _varlen(dout.to(q.dtype), rows.q_rows), _varlen(q, rows.q_rows), _varlen(k, rows.kv_rows, groups),
        _varlen(v, rows.kv_rows, groups), _varlen(out.to(q.dtype), rows.q_rows),
        lse[:, rows.q_rows].contiguous(), rows.cu_q, rows.cu_kv, rows.max_q, rows.max_kv, 0.0, segments.causal,
        rng_state, unused, scale=scale)
    dq[:, rows.q_rows] = piece_dq.transpose(0, 1).float()
    dk[:, rows.kv_rows] = _fold_kv(piece_dk.transpose(0, 1).float(), groups)
    dv[:, rows.kv_rows] = _fold_kv(piece_dv.transpose(0, 1).float(), groups)
    return dq, dk, dv


def _segment_slices(segments: Segments):
    """Each sequence's query and key/value slices (a causal block is square: flash's causal mask is
    aligned at the top, the same as at the end only then)."""
    q_start = kv_start = 0
    for q_len, kv_len in zip(segments.q_lengths, segments.kv_lengths, strict=True):
        if q_len and kv_len:
            if segments.causal and q_len != kv_len:
                raise ValueError(f"a causal block must be square (queries {q_len}, keys {kv_len})")
            yield slice(q_start, q_start + q_len), slice(kv_start, kv_start + kv_len)
        q_start, kv_start = q_start + q_len, kv_start + kv_len


def _causal_bias(first: int, end: int, q_len: int, kv_len: int, device) -> torch.Tensor:
    """Query rows first..end-1 of a q_len x kv_len block aligned at the ends: 0 where key j may be
    seen by query i (j <= i + kv_len - q_len), -inf elsewhere."""
    rows = torch.arange(first, end, device=device)[:, None] + (kv_len - q_len)
    return torch.where(torch.arange(kv_len, device=device)[None] <= rows, 0.0, -math.inf)


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor,
          index: torch.Tensor) -> None:
    """Fold a block's partial result into the running one at the query positions `index`:
    lse' = log(e^lse + e^lse_b), out' = out e^(lse - lse') + out_b e^(lse_b - lse')."""
    old_out, old_lse = out[:, index], lse[:, index]
    new_lse = torch.logaddexp(old_lse, block_lse)
    out[:, index] = old_out * torch.exp(old_lse - new_lse)[..., None] + block_out * torch.exp(block_lse - new_lse)[..., None]
    lse[:, index] = new_lse


@dataclass(frozen=True)
class Ring:
    """This rank's place in its CP group, and the per-step layouts of the current micro-batch."""

    group: object  # the CP process group
    rank: int  # within the group
    size: int
    steps: tuple[Segments, ...]  # indexed by step: the key/values of rank (rank - step) % size

    def shift(self, tensor: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Start sending `tensor` to the next rank and receiving the previous rank's; the receive
        buffer and the requests to wait on."""
        received = torch.empty_like(tensor)
        requests = [dist.isend(tensor.contiguous(), group=self.group, group_dst=(self.rank + 1) % self.size),
                    dist.irecv(received, group=self.group, group_src=(self.rank - 1) % self.size)]
        return received, requests


def _wait(requests: list) -> None:
    for request in requests:
        request.wait()


class BlockAttention(torch.autograd.Function):
    """One block's exact attention as an autograd function that keeps only q, k, v, the output and
    the log-sum-exp for backward (Ulysses' whole-sequence attention)."""

    @staticmethod
    def forward(ctx, q, k, v, segments: Segments, scale: float):
        out, lse = attend_block(q, k, v, segments, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.segments, ctx.scale = segments, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = attend_block_backward(dout, q, k, v, out, lse, ctx.segments, ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


class RingAttention(torch.autograd.Function):
    """q [Hq, T, D], k, v [Hkv, T, D] of this rank's tokens -> [Hq, T, D] in q's dtype."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, scale: float):
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        for step, segments in enumerate(ring.steps):
            pending = ring.shift(kv) if step + 1 < ring.size else None
            block_out, block_lse = attend_block(q[:, segments.q_index], kv[0][:, segments.kv_index],
                                                kv[1][:, segments.kv_index], segments, scale)
            merge(out, lse, block_out, block_lse, segments.q_index)
            if pending is not None:
                _wait(pending[1])
                kv = pending[0]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale = ring, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale = ctx.ring, ctx.scale
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # travels with the key/values it is for
        for step, segments in enumerate(ring.steps):
            last = step + 1 == ring.size
            pending_kv = None if last else ring.shift(kv)
            block_dq, block_dk, block_dv = attend_block_backward(
                dout[:, segments.q_index], q[:, segments.q_index], kv[0][:, segments.kv_index],
                kv[1][:, segments.kv_index], out[:, segments.q_index], lse[:, segments.q_index], segments, scale)
            dq[:, segments.q_index] += block_dq
            dkv[0][:, segments.kv_index] += block_dk
            dkv[1][:, segments.kv_index] += block_dv
            # After the last step this rank holds the next rank's key/values: one more hop home.
            dkv, requests = ring.shift(dkv)
            _wait(requests)
            if pending_kv is not None:
                _wait(pending_kv[1])
                kv = pending_kv[0]
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None
