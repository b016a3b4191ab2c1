"""One SDPA call per decode step and layer for SGLang's torch_native attention backend (CPU).

SGLang's `TorchNativeAttnBackend._run_sdpa_forward_decode` loops over the batch in Python, one
SDPA call per request: with 64 requests, a 6-layer model makes ~400 tiny calls per generated
token, and on a CPU that loop is most of the time of a decode step. Here the batch's keys and
values are gathered from the KV cache into [B, max_len] (positions past a request's length
masked out) and attended in one call. Masked positions get zero weight, so the result is each
request's own attention (up to summation order).

Applied by `sitecustomize` when SGLang imports the backend, on CPU servers only; cases the
batched form does not cover (cross-attention, encoder lengths, sliding windows) keep the loop.
"""

from __future__ import annotations

import torch


def batched_decode(original):
    def _run_sdpa_forward_decode(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                                 encoder_lens=None, scaling=None, enable_gqa=False, causal=False,
                                 is_cross_attn=False, sliding_window_size=None):
        if encoder_lens is not None or is_cross_attn or (sliding_window_size is not None and sliding_window_size > -1):
            return original(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                            encoder_lens, scaling=scaling, enable_gqa=enable_gqa, causal=causal,
                            is_cross_attn=is_cross_attn, sliding_window_size=sliding_window_size)
        max_len = int(seq_lens.max())
        slots = req_to_token[req_pool_indices, :max_len].long()  # [B, L] cache slots of each request's tokens
        key = k_cache[slots].transpose(1, 2)  # [B, Hkv, L, D]
        value = v_cache[slots].transpose(1, 2)
        if key.dtype != query.dtype:
            key, value = key.to(query.dtype), value.to(query.dtype)
        valid = torch.arange(max_len, device=query.device)[None, :] < seq_lens[:, None]  # [B, L]
        attended = torch.nn.functional.scaled_dot_product_attention(
            query.unsqueeze(2), key, value, attn_mask=valid[:, None, None, :], scale=scaling, enable_gqa=enable_gqa,
        )  # [B, H, 1, Dv]
        output.copy_(attended.squeeze(2))
        return output

    _run_sdpa_forward_decode.rlsys_original = original
    return _run_sdpa_forward_decode


def patch(module) -> None:
    backend = module.TorchNativeAttnBackend
    if not hasattr(backend._run_sdpa_forward_decode, "rlsys_original"):
        backend._run_sdpa_forward_decode = batched_decode(backend._run_sdpa_forward_decode)
