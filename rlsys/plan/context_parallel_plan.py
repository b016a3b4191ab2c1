"""Context parallelism in the memory plan (`trainer.context_parallel_size`, CP): a rank's
micro-batch is its share of each packed sequence (padded to 2 x CP, over CP: `rank_share`,
`rank_tokens`), so activations and logits per rank divide by CP; the CP attention adds its own
terms (`context_parallel_terms`); and when the longest sequence does not fit a rank even alone,
`smallest_context_parallel` searches for the smallest CP that fits, which `plan_memory` names."""

from __future__ import annotations

from collections.abc import Callable

from rlsys.actors.cp_layout import padded_length
from rlsys.actors.ring_attention import score_chunks
from rlsys.config import RunConfig, check_context_parallel
from rlsys.model.shape import GiB, ModelShape


def rank_share(length: int, cp: int) -> int:
    """One sequence's tokens on each rank of its CP group (actors/trainer.py, `_micro_batches`): the
    whole with CP 1, else its length padded to a multiple of 2 x CP, over CP."""
    return length if cp == 1 else padded_length(length, cp) // cp


def rank_tokens(config: RunConfig, longest: int) -> int:
    """A rank's tokens in its largest micro-batch. Packed: the budget, or the longest sequence's
    share when that is more (a sequence over the budget goes alone: `split_by_token_budget`);
    padded: micro_batch_size rows of the longest."""
    t = config.trainer
    if not t.packing:
        return t.micro_batch_size * longest
    return max(t.max_tokens_per_microbatch, rank_share(longest, t.context_parallel_size))


def context_parallel_terms(shape: ModelShape, config: RunConfig, tokens: int, longest: int,
                           compute_bytes: int) -> dict[str, int]:
    """What the CP attention (actors/context_parallel.py, ring_attention.py) holds on a rank of
    `tokens` local tokens, beyond the activation estimate; all 0 without CP. T = tokens, Hq, Hkv, D.

    attention_saved: kept per layer for backward (one layer with checkpointing): the fp32 output and
    log-sum-exp, Hq x T x (D + 1) x 4; Ulysses also its head-split q, k, v, (Hq + 2 Hkv) x T x D.
    attention_block: one call of the exact block backward (the larger of the two) at its largest
    block, the longest sequence's queries against its own keys (ring: its share on this rank, both
    chunks; Ulysses: the whole padded sequence, Hq / CP heads), taken in pieces of h heads x r query
    rows whose fp32 scores fit SCORE_BUDGET_BYTES (`score_chunks`): 4 fp32 score-sized buffers of a
    piece (scores, p, dO v^T - delta, ds), the piece's fp32 q and dO rows and its heads' fp32 k, v,
    and the block's fp32 dq, dk, dv, delta (ring: plus its selected copies of dO, q, out, lse, k, v).
    ring_buffers (backward): this rank's key/values [2, Hkv, T, D] and the received ones, their fp32
    gradients travelling around the ring and the received ones, and the fp32 dq accumulator.
    ulysses_buffers: the all-to-all's send and receive buffers of q, k, v and their head-major copy,
    3 x (Hq + 2 Hkv) x T x D."""
    t = config.trainer
    cp, ulysses = t.context_parallel_size, t.context_parallel_style == "ulysses"
    terms = dict.fromkeys(("attention_saved", "attention_block", "ring_buffers", "ulysses_buffers"), 0)
    if cp == 1:
        return terms
    hq, hkv, d, c = shape.heads, shape.kv_heads, shape.head_dim, compute_bytes
    qkv = (hq + 2 * hkv) * tokens * d * c
    kept = 1 if t.gradient_checkpointing else shape.layers
    terms["attention_saved"] = kept * (hq * tokens * (d + 1) * 4 + (qkv if ulysses else 0))
    heads, kv_heads = (hq // cp, hkv // cp) if ulysses else (hq, hkv)
    block = padded_length(longest, cp) if ulysses else rank_share(longest, cp)
    h, rows = score_chunks(heads, heads // kv_heads, block, block)
    outputs = hq * tokens * (d + 1) * 4 + 2 * hkv * tokens * d * 4  # dq, delta; dk, dv
    selected = 0 if ulysses else hq * tokens * (2 * d * c + 4 * d + 4) + 2 * hkv * tokens * d * c
    piece = 2 * h * rows * d * 4 + 2 * h * block * d * 4 + 4 * 4 * h * rows * block
    terms["attention_block"] = outputs + selected + piece
    if ulysses:
        terms["ulysses_buffers"] = 3 * qkv
    else:
        terms["ring_buffers"] = 2 * 2 * hkv * tokens * d * (c + 4) + hq * tokens * d * 4
    return terms


def smallest_context_parallel(config: RunConfig, shape: ModelShape, longest: int, plan: Callable) -> tuple[int, str]:
    """The smallest CP (a divisor of num_ranks; for Ulysses one dividing both head counts; the
    config's style first, then ring) whose plan fits, else whose plan with the longest sequence alone
    in a micro-batch fits; and what to set. (0, why) when none fits. `plan(cp, style, budget=None)`:
    the memory plan of `config` at that CP and style (and micro-batch budget)."""
    t = config.trainer
    try:
        check_context_parallel(t.model_copy(update={"context_parallel_size": 2}), config.algorithm)
    except ValueError as error:
        return 0, f"context parallelism cannot split it: {error}"
    styles = dict.fromkeys([t.context_parallel_style, "ring"])
    for size in (size for size in range(1, t.num_ranks + 1) if t.num_ranks % size == 0):
        for style in styles if size > 1 else [t.context_parallel_style]:
            if (size, style) == (t.context_parallel_size, t.context_parallel_style) or style == "ulysses" and (
                    shape.heads % size or shape.kv_heads % size):
                continue
            named = f"trainer.context_parallel_size={size}" + (
                f" trainer.context_parallel_style={style}" if style != t.context_parallel_style and size > 1 else "")
            if plan(size, style).fits:
                return size, f"set {named}, the smallest that fits"
            share = rank_share(longest, size)
            if plan(size, style, budget=share).fits:
                return size, (f"set {named} with trainer.max_tokens_per_microbatch<={share:,} (its share of the "
                              "longest sequence), the smallest that fits")
    largest = plan(t.num_ranks, "ring", budget=rank_share(longest, t.num_ranks))
    return 0, (f"no trainer.context_parallel_size dividing trainer.num_ranks={t.num_ranks} fits it (ring at "
               f"{t.num_ranks}, the sequence alone: {largest.per_gpu_bytes / GiB:.1f} GiB): raise trainer.num_ranks, "
               "lower rollout.engine.context_length, or use GPUs with more memory")
