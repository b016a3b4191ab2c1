"""The CPU engine's batched decode and prefill attention (rollout/sglang/cpu_compat) equal SGLang's own
one-request-at-a-time loops, and the server's compatibility layer installs them."""

from __future__ import annotations

import os
import subprocess
import sys

from rlsys.rollout.sglang.server import CPU_COMPAT_SITE

# Runs where the SGLang server runs: with the compatibility layer first on the path.
CHECK = r"""
import torch
from sglang.srt.layers.attention import torch_native_backend as module

decode = module.TorchNativeAttnBackend._run_sdpa_forward_decode
assert hasattr(decode, "rlsys_original"), "the batched decode was not installed"
torch.manual_seed(0)
heads, kv_heads, dim, slots = 6, 2, 16, 200
k_cache, v_cache = torch.randn(slots, kv_heads, dim), torch.randn(slots, kv_heads, dim)
seq_lens = torch.tensor([7, 1, 30, 12])  # ragged, one request with a single token
req_to_token = torch.randint(0, slots, (8, 64), dtype=torch.int32)  # stale slots past each length
req_pool_indices = torch.tensor([5, 0, 3, 6])
query = torch.randn(4, heads, dim)
args = (k_cache, v_cache, req_to_token, req_pool_indices, seq_lens)
kwargs = dict(scaling=dim ** -0.5, enable_gqa=True)
ours = decode(None, query, torch.empty(4, heads, dim), *args, **kwargs)
theirs = decode.rlsys_original(None, query, torch.empty(4, heads, dim), *args, **kwargs)
error = (ours - theirs).abs().max().item()
# Without grouped-query attention (as many key/value heads as query heads)
mha_cache = (torch.randn(slots, heads, dim), torch.randn(slots, heads, dim))
mha = (*mha_cache, req_to_token, req_pool_indices, seq_lens)
ours = decode(None, query, torch.empty(4, heads, dim), *mha, scaling=dim ** -0.5, enable_gqa=False)
theirs = decode.rlsys_original(None, query, torch.empty(4, heads, dim), *mha, scaling=dim ** -0.5, enable_gqa=False)
error = max(error, (ours - theirs).abs().max().item())
assert error < 1e-6, error

# Prefill (extend): requests with cached prefixes of different lengths, one without a prefix,
# one extending by a single token.
extend = module.TorchNativeAttnBackend._run_sdpa_forward_extend
assert hasattr(extend, "rlsys_original"), "the batched prefill was not installed"
prefix_lens, extend_lens = torch.tensor([0, 5, 2, 9]), torch.tensor([7, 1, 10, 3])
seq_lens = prefix_lens + extend_lens
query = torch.randn(int(extend_lens.sum()), heads, dim)
args = (k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, prefix_lens, extend_lens)
kwargs = dict(scaling=dim ** -0.5, enable_gqa=True, causal=True)
ours = extend(None, query, torch.zeros(query.shape[0], heads, dim), *args, **kwargs)
theirs = extend.rlsys_original(None, query, torch.zeros(query.shape[0], heads, dim), *args, **kwargs)
error = max(error, (ours - theirs).abs().max().item())
assert error < 1e-6, error
print("ok", error)
"""


def test_batched_decode_and_prefill_attention_equal_sglangs_per_request_loops():
    env = {**os.environ, "PYTHONPATH": str(CPU_COMPAT_SITE), "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("ok")
