"""The CPU engine's batched decode and prefill attention (rollout/cpu_compat) equal SGLang's own
one-request-at-a-time loops, and the server's compatibility layer installs them."""

from __future__ import annotations

import os
import subprocess
import sys

from rlsys.rollout.server import CPU_COMPAT_SITE

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


# Decode steps as SGLang's scheduler runs them: each step writes the batch's newest token to a free
# cache slot, then attends; a prefill brings a new request in (here in the pool slot a finished
# request left, with that request's length), requests finish and leave. Each step's
# attention, through the padded keys and values the backend keeps between steps, equals SGLang's
# per-request loop over the cache.
STEPS = r"""
import types
import torch
import rlsys_batched_decode
from sglang.srt.layers.attention import torch_native_backend as module

decode = module.TorchNativeAttnBackend._run_sdpa_forward_decode
extend = module.TorchNativeAttnBackend._run_sdpa_forward_extend
budget = int(__import__("sys").argv[1])
rlsys_batched_decode.MAX_PADDED_KV_BYTES = budget
torch.manual_seed(0)
heads, kv_heads, dim, slots = 6, 2, 16, 1000
k_cache, v_cache = torch.zeros(slots, kv_heads, dim), torch.zeros(slots, kv_heads, dim)
req_to_token = torch.zeros(8, 128, dtype=torch.int32)
free = torch.randperm(slots - 1)[:] + 1  # scattered slots, as a busy allocator hands them out
taken = 0
backend = types.SimpleNamespace()  # the backend instance the kept tensors live on
kwargs = dict(scaling=dim ** -0.5, enable_gqa=True)

def write_token(pool_index, position):
    global taken
    slot = free[taken]; taken += 1
    req_to_token[pool_index, position] = slot
    k_cache[slot], v_cache[slot] = torch.randn(kv_heads, dim), torch.randn(kv_heads, dim)

def prefill(pool_indices, lengths):
    for pool_index, length in zip(pool_indices, lengths):
        for position in range(length):
            write_token(pool_index, position)
    seq_lens, prefix = torch.tensor(lengths), torch.zeros(len(lengths), dtype=torch.long)
    query = torch.randn(int(seq_lens.sum()), heads, dim)
    extend(backend, query, torch.zeros_like(query), k_cache, v_cache, req_to_token, torch.tensor(pool_indices),
           seq_lens, prefix, seq_lens, causal=True, **kwargs)

error = 0.0
def step(pool_indices, seq_lens):
    global error
    for pool_index, length in zip(pool_indices.tolist(), seq_lens.tolist()):
        write_token(pool_index, length - 1)
    query = torch.randn(len(pool_indices), heads, dim)
    args = (k_cache, v_cache, req_to_token, pool_indices, seq_lens)
    ours = decode(backend, query, torch.empty(len(pool_indices), heads, dim), *args, **kwargs)
    theirs = decode.rlsys_original(None, query, torch.empty(len(pool_indices), heads, dim), *args, **kwargs)
    error = max(error, (ours - theirs).abs().max().item())

pool, lens = [5, 0, 3, 6], [7, 1, 30, 12]
prefill(pool, lens)
pool_indices, seq_lens = torch.tensor(pool), torch.tensor(lens)
for _ in range(70):  # past the kept tensors' first capacity: they grow
    seq_lens = seq_lens + 1
    step(pool_indices, seq_lens)
kept = len(getattr(backend, "_rlsys_padded_kv", {}))
# The request in pool slot 0 finishes and a new one takes the slot, prefilled to the length the
# old one had: the next batch looks like the last one advanced by a token, but row 1 is new.
prefill([0], [int(seq_lens[1])])
for _ in range(3):
    seq_lens = seq_lens + 1
    step(pool_indices, seq_lens)
keep = [0, 2, 3]  # then it finishes too: the others go on, their rows kept
pool_indices, seq_lens = pool_indices[keep], seq_lens[keep]
for _ in range(3):
    seq_lens = seq_lens + 1
    step(pool_indices, seq_lens)
assert error < 1e-6, error
print("ok", kept, error)
"""


def _run_in_server_environment(script: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(CPU_COMPAT_SITE), "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_batched_decode_and_prefill_attention_equal_sglangs_per_request_loops():
    assert _run_in_server_environment(CHECK).startswith("ok")


def test_decode_steps_through_the_kept_keys_and_values_equal_sglangs_loop():
    status, kept, _ = _run_in_server_environment(STEPS, str(1 << 30)).split()
    assert (status, kept) == ("ok", "1")  # one layer's keys and values were kept between steps


def test_decode_over_the_kept_memory_budget_gathers_every_step_and_stays_exact():
    status, kept, _ = _run_in_server_environment(STEPS, "1024").split()
    assert (status, kept) == ("ok", "0")
