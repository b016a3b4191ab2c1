"""Packed attention through torch's own varlen flash kernel (`torch.nn.attention.varlen`), for GPUs
without flash-attn.

A packed micro-batch is one row of sequences laid back to back (`MicroBatch.cu_seq_lens` holds
their boundaries, as flash-attn's varlen arguments). Packed SDPA (`actors/packed_attention.py`)
attends them with one SDPA call per distinct length; on a GPU that is a launch, a gather and a
scatter per length. torch's `varlen_attn` is flash attention over all of them in one call (the GPU
proof kit measured it 2.2-2.7x faster on the same packed batch, H200, torch 2.11).

Registered with transformers under `PACKED_VARLEN` and chosen by `choose_attention` where the kernel
runs (a CUDA GPU of compute capability 8.0 or newer, a 16-bit compute dtype, flash-attn not
installed). A call the kernel cannot take (not packed, a padding mask, a sliding window, fp32, a head
dimension flash attention does not support: `cuda_flash_takes`) is packed SDPA's, so every input
still gets an answer.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from rlsys.actors.packed_attention import packed_sdpa_attention, packed_sdpa_mask, sequence_starts
from rlsys.system.backend import PACKED_VARLEN, cuda_flash_takes


def varlen_kernel() -> Callable:
    """torch's varlen attention (the function the attention calls; tests give a CPU stand-in)."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


def kernel_arguments(kernel: Callable, kv_heads_differ: bool, scale: float | None, head_dim: int) -> dict | None:
    """The kernel's keywords for causal attention at `scale`, in the spelling of this torch:
    `is_causal=True` up to torch 2.10, `window_size=(-1, 0)` from 2.11; `enable_gqa` where it exists
    and the key/value heads are fewer than the query heads (else the caller repeats them); `scale`
    where it is taken. None when this kernel cannot compute it (a scale other than 1/sqrt(head_dim)
    and no `scale` argument)."""
    parameters = inspect.signature(kernel).parameters
    arguments = {"is_causal": True} if "is_causal" in parameters else {"window_size": (-1, 0)}
    if kv_heads_differ and "enable_gqa" in parameters:
        arguments["enable_gqa"] = True
    if "scale" in parameters:
        arguments["scale"] = scale
    elif scale is not None and abs(scale - head_dim**-0.5) > 1e-12 * head_dim**-0.5:
        return None
    return arguments


def _boundaries(position_ids: torch.Tensor, total: int, kwargs: dict) -> tuple[torch.Tensor, int]:
    """(cu_seq_lens int32 on the queries' device, longest sequence): the micro-batch's own when it
    passed them, else from the position resets."""
    cu = kwargs.get("cu_seq_lens_q")
    longest = kwargs.get("max_length_q")
    if cu is None:
        starts = sequence_starts(position_ids[0])
        if not starts or starts[0] != 0:
            starts = [0, *starts]
        cu = torch.tensor([*starts, total], dtype=torch.int32, device=position_ids.device)
        longest = None
    cu = cu.to(device=position_ids.device, dtype=torch.int32)
    if longest is None:
        longest = int((cu[1:] - cu[:-1]).max())
    return cu, int(longest)


def packed_varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """query [1, H, T, D], key/value [1, Hkv, T, D] -> ([1, T, H, D], None), as transformers' SDPA."""
    position_ids = kwargs.get("position_ids")
    if (attention_mask is not None or position_ids is None or query.shape[0] != 1
            or query.shape[2] != key.shape[2] or kwargs.get("sliding_window") or kwargs.get("dropout", 0.0)
            or not cuda_flash_takes(query)):
        return packed_sdpa_attention(module, query, key, value, attention_mask, **kwargs)
    kernel = varlen_kernel()
    total, heads, kv_heads = query.shape[2], query.shape[1], key.shape[1]
    arguments = kernel_arguments(kernel, kv_heads != heads, kwargs.get("scaling"), query.shape[-1])
    if arguments is None:
        return packed_sdpa_attention(module, query, key, value, attention_mask, **kwargs)
    cu, longest = _boundaries(position_ids, total, kwargs)
    # varlen layout: [T, heads, D]
    q, k, v = (states[0].transpose(0, 1) for states in (query, key, value))
    if kv_heads != heads and "enable_gqa" not in arguments:
        k, v = (states.repeat_interleave(heads // kv_heads, dim=1) for states in (k, v))
    out = kernel(q, k, v, cu, cu, longest, longest, **arguments)
    return out[None], None


def register_packed_varlen() -> str:
    """Make `PACKED_VARLEN` a name transformers accepts as `attn_implementation` (idempotent); its
    mask function is packed SDPA's (no mask for packed rows)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(PACKED_VARLEN, packed_varlen_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_VARLEN, packed_sdpa_mask)
    return PACKED_VARLEN
