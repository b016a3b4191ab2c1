"""SDPA that attends within each packed sequence, without a pack-length mask.

A packed micro-batch is one row of sequences laid back to back, `position_ids` restarting at 0
at each. transformers' own SDPA path turns that into a dense [T, T] block-causal mask, so the
attention costs O(T^2) for a pack of T tokens, most of it masked out. Here the sequences of equal
length are gathered into a batch and attended causally, one SDPA call per distinct length: the
cost is the sum of len^2, and the numbers are those of attending each sequence alone.

Registered with transformers under `PACKED_SDPA`; with a padding mask, or rows that are not
packed, it is transformers' SDPA unchanged. flash-attn (GPU, 16-bit) has varlen kernels and
handles packing itself.
"""

from __future__ import annotations

import torch

from rlsys.system.backend import PACKED_SDPA


def sequence_starts(position_ids: torch.Tensor) -> list[int]:
    """Offsets where a packed row's sequences begin (its positions restart at 0)."""
    return (position_ids == 0).nonzero().flatten().tolist()


def _starts(position_ids: torch.Tensor, cu_seq_lens: torch.Tensor | None) -> list[int]:
    """The micro-batch's own sequence boundaries when it passed them (`MicroBatch.cu_seq_lens`),
    else the position resets: the same offsets either way."""
    if cu_seq_lens is not None:
        return cu_seq_lens[:-1].tolist()
    return sequence_starts(position_ids)


def packed_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """query [1, H, T, D], key/value [1, Hkv, T, D] -> ([1, T, H, D], None), as transformers' SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    position_ids = kwargs.get("position_ids")
    if attention_mask is not None or position_ids is None or query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    total = query.shape[2]
    starts = _starts(position_ids[0], kwargs.get("cu_seq_lens_q"))
    if len(starts) <= 1:
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)
    by_length: dict[int, list[int]] = {}
    for start, end in zip(starts, [*starts[1:], total], strict=True):
        by_length.setdefault(end - start, []).append(start)
    if starts[0] != 0:  # tokens before the first sequence start (never built by rlsys): their own sequence
        by_length.setdefault(starts[0], []).append(0)
    output = query.new_empty(1, total, query.shape[1], query.shape[3])
    for length, group_starts in by_length.items():
        # Token indices of this group's sequences, sequence by sequence: [n * length]
        index = (torch.tensor(group_starts, device=query.device)[:, None]
                 + torch.arange(length, device=query.device)).flatten()
        grouped = [_gather(states, index, len(group_starts)) for states in (query, key, value)]
        attended, _ = sdpa_attention_forward(module, *grouped, None, **kwargs)
        output = output.index_copy(1, index, attended.reshape(1, -1, *attended.shape[2:]))
    return output, None


def _gather(states: torch.Tensor, index: torch.Tensor, count: int) -> torch.Tensor:
    """[1, H, T, D] -> [count, H, length, D]: the tokens at `index`, `count` sequences in a row."""
    heads, dim = states.shape[1], states.shape[3]
    return states[0].index_select(1, index).view(heads, count, -1, dim).transpose(0, 1)


def packed_sdpa_mask(*args, **kwargs):
    """No mask for packed rows (the attention finds the sequences); SDPA's mask for padded ones."""
    from transformers.masking_utils import sdpa_mask

    if kwargs.get("attention_mask") is None:
        return None
    return sdpa_mask(*args, **kwargs)


def register_packed_sdpa() -> str:
    """Make `PACKED_SDPA` a name transformers accepts as `attn_implementation` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_SDPA, packed_sdpa_mask)
    return PACKED_SDPA
