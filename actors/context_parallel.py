"""Context parallelism (CP): each sequence's tokens split over a group of ranks.

The trainer's ranks form `trainer.num_ranks / CP` data-parallel groups of CP consecutive ranks; a
group's ranks take the same sequences, and FSDP2 still shards the parameters over every rank (as
torchtitan flattens dp_shard x cp). Each sequence of a packed micro-batch is padded to a multiple
of 2 x CP and cut into 2 x CP chunks; CP rank r keeps chunks r and 2CP-1-r (zigzag: with a causal
mask every rank then has the same attention work). A rank's micro-batch is its chunks laid back to
back, with the tokens' own positions (rotary embeddings see the real ones) and, per token, the
target and loss values of the whole sequence's layout: the label of a chunk's last token is the
first token of the next chunk, which every rank knows (it holds the whole sequence's ids).
Padding tokens carry no loss weight and sit after every real token, which a causal mask hides.

Attention crosses the group by ring (actors/ring_attention.py) or Ulysses (all-to-all from the
sequence split to a head split, attention over whole sequences, and back); both are one
transformers attention function, `CONTEXT_PARALLEL`, which reads the micro-batch's layout from the
model call's `context_parallel` keyword (transformers passes a call's extra keywords to every
attention layer).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlsys.actors.batching import MicroBatch
from rlsys.actors.cp_layout import ContextParallelGroup, ContextParallelLayout, build_layout, zigzag_positions
from rlsys.actors.ring_attention import BlockAttention, Ring, RingAttention, Segments

CONTEXT_PARALLEL = "rlsys_context_parallel"


def shard_micro_batch(batch: MicroBatch, cp: ContextParallelGroup) -> MicroBatch:
    """This rank's part of a packed micro-batch (one row): its zigzag chunks of every sequence.
    Per-token tensors become [1, T_local] and are aligned with the inputs (the target of each local
    token, not shifted): `MicroBatch.context_parallel` marks it."""
    if batch.input_ids.shape[0] != 1 or batch.cu_seq_lens is None:
        raise ValueError("context parallelism needs packed micro-batches (trainer.packing=true)")
    device = batch.input_ids.device
    lengths = (batch.cu_seq_lens[1:] - batch.cu_seq_lens[:-1]).tolist()  # a dummy micro-batch: one 2-token row
    layout = build_layout(lengths, cp, device)
    index = layout.local_sources
    real = index >= 0
    at = torch.where(real, index, 0)

    def pick(values: torch.Tensor, fill) -> torch.Tensor:
        return torch.where(real, values[0, at], torch.as_tensor(fill, dtype=values.dtype, device=device))[None]

    def pick_target(values: torch.Tensor | None) -> torch.Tensor | None:
        if values is None:
            return None
        return pick(torch.nn.functional.pad(values, (0, 1)), 0)  # the last token of the row predicts nothing

    positions = torch.cat([torch.tensor(zigzag_positions(n, cp.size, cp.rank), device=device) for n in lengths])
    return MicroBatch(
        input_ids=pick(batch.input_ids, 0), position_ids=positions[None], attention_mask=None,
        targets=pick_target(batch.targets),
        response_mask=pick_target(batch.response_mask), loss_weights=pick_target(batch.loss_weights),
        advantages=pick_target(batch.advantages), engine_logprobs=pick_target(batch.engine_logprobs),
        engine_mask=pick_target(batch.engine_mask), indices=batch.indices, spans=batch.spans,
        old_logprobs=pick_target(batch.old_logprobs), ref_logprobs=pick_target(batch.ref_logprobs),
        context_parallel=layout,
    )


def unshard_values(layout: ContextParallelLayout, values: torch.Tensor) -> torch.Tensor:
    """[1, T_local] per-token values of every CP rank -> [1, T - 1] in the unsplit row's target
    layout (what `MicroBatch.spans` index). A collective within the CP group."""
    cp = layout.cp
    gathered = [torch.empty_like(values) for _ in range(cp.size)]
    dist.all_gather(gathered, values.contiguous(), group=cp.group)
    row = values.new_zeros(1, layout.row_length + 1)
    for part, source in zip(gathered, layout.sources, strict=True):
        real = source >= 0
        row[0, source[real]] = part[0, real]
    return row[:, : max(layout.row_length - 1, 0)]


# ---- the attention function ---------------------------------------------------------------
def context_parallel_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: torch.Tensor | None, scaling: float | None = None,
                               **kwargs) -> tuple[torch.Tensor, None]:
    """query [1, Hq, T, D], key/value [1, Hkv, T, D] of this rank's tokens -> ([1, T, Hq, D], None).
    Without a `context_parallel` layout (a call outside a CP micro-batch), packed SDPA."""
    layout: ContextParallelLayout | None = kwargs.pop("context_parallel", None)
    if layout is None:
        from rlsys.actors.packed_attention import packed_sdpa_attention

        return packed_sdpa_attention(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if layout.cp.style == "ulysses":
        output = ulysses_attention(query[0], key[0], value[0], layout, scale)
    else:
        ring = Ring(layout.cp.group, layout.cp.rank, layout.cp.size, layout.steps)
        output = RingAttention.apply(query[0], key[0], value[0], ring, scale)
    return output.transpose(0, 1)[None], None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: ContextParallelLayout,
                      scale: float) -> torch.Tensor:
    """Sequence split -> head split (all-to-all), causal attention over whole padded sequences, and
    back. q [Hq, T, D], k, v [Hkv, T, D] -> [Hq, T, D]."""
    cp = layout.cp
    order = _ulysses_order(layout)  # whole-sequence order of the gathered tokens

    # q, k and v travel in one all-to-all: one collective instead of three, and their backward is
    # then one call too, whose order no rank can take differently from another.
    heads = [q.shape[0] // cp.size, k.shape[0] // cp.size, v.shape[0] // cp.size]
    parts = torch.cat([states.unflatten(0, (cp.size, -1)) for states in (q, k, v)], dim=1)  # [CP, H / CP, T, D]
    gathered = _AllToAll.apply(parts, cp.group)  # [CP (from), H / CP, T, D]: part p came from rank p
    qh, kh, vh = gathered.transpose(0, 1).flatten(1, 2)[:, order].split(heads)  # [H / CP, CP x T, D] each
    padded = [2 * c * cp.size for c in layout.chunk_lengths]
    everything = torch.arange(sum(padded), device=q.device)
    segments = Segments(everything, everything, tuple(padded), tuple(padded), causal=True)
    out = BlockAttention.apply(qh, kh, vh, segments, scale)  # [Hq / CP, CP x T, D]
    back = out[:, torch.argsort(order)]  # rank-major again
    parts = back.unflatten(1, (cp.size, -1)).transpose(0, 1).contiguous()  # [CP (to), Hq / CP, T, D]
    returned = _AllToAll.apply(parts, cp.group)  # [CP (heads from), Hq / CP, T, D]
    return returned.flatten(0, 1)


def _ulysses_order(layout: ContextParallelLayout) -> torch.Tensor:
    """For the rank-major concatenation of every CP rank's local tokens, the permutation that puts
    them in whole-sequence order (each padded sequence contiguous, positions ascending)."""
    cp, chunks = layout.cp, layout.chunk_lengths
    local = sum(2 * c for c in chunks)
    order, sequence_start = [], 0
    for chunk in chunks:
        for piece in range(2 * cp.size):  # the padded sequence's chunks in order
            rank = piece if piece < cp.size else 2 * cp.size - 1 - piece
            half = 0 if piece < cp.size else 1
            start = rank * local + sequence_start + half * chunk
            order += range(start, start + chunk)
        sequence_start += 2 * chunk
    return torch.tensor(order, dtype=torch.long, device=layout.sources[0].device)


class _AllToAll(torch.autograd.Function):
    """[CP, ...] -> [CP, ...]: part p goes to rank p, part p of the result came from rank p. Its own
    transpose, so the backward sends each gradient part back where its input came from."""

    @staticmethod
    def forward(ctx, parts: torch.Tensor, group):
        ctx.group = group
        return _all_to_all(parts, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group), None


def _all_to_all(parts: torch.Tensor, group) -> torch.Tensor:
    parts = parts.contiguous()
    received = torch.empty_like(parts, memory_format=torch.contiguous_format)  # the collective writes it densely
    dist.all_to_all_single(received, parts, group=group)
    return received


def _no_mask(*args, **kwargs):
    """CP rows are packed: the attention finds the sequences from the layout."""
    return None


def register_context_parallel_attention() -> str:
    """Make `CONTEXT_PARALLEL` a name transformers accepts as `attn_implementation` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(CONTEXT_PARALLEL, context_parallel_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(CONTEXT_PARALLEL, _no_mask)
    return CONTEXT_PARALLEL
