"""Packed attention through torch's varlen flash kernel (GPUs without flash-attn).

The kernel itself is CUDA-only (torch's `_flash_attention_forward` has no CPU implementation); the
GPU proof kit checks it on a GPU (`packed_attention`, `varlen_attention`). Here a CPU stand-in with
the kernel's contract (varlen layout [T, H, D], cu_seq_lens, causal spelled either way, enable_gqa,
scale), computed by SDPA sequence by sequence, checks everything rlsys does around it: the layout,
the boundaries, grouped key/value heads, the scale, the causal keywords per torch version, and the
calls that must stay packed SDPA's."""

from __future__ import annotations

import torch

from rlsys.actors import varlen_attention
from rlsys.actors.varlen_attention import PACKED_VARLEN, kernel_arguments, register_packed_varlen
from rlsys.system.backend import cuda_flash_takes
from tests.unit.test_packed_attention import _model as packed_attention_model

LENGTHS = [5, 9, 5, 1, 13, 9, 5]


def stand_in_kernel(calls: list):
    """A CPU kernel with torch 2.11+'s varlen_attn signature (window_size, enable_gqa)."""

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
        assert query.dim() == 3 and cu_seq_q.dtype == torch.int32 and torch.equal(cu_seq_q, cu_seq_k)
        calls.append({"cu": cu_seq_q.tolist(), "max": (max_q, max_k), "window": tuple(window_size),
                      "gqa": enable_gqa, "heads": (query.shape[1], key.shape[1]), "scale": scale})
        bounds = cu_seq_q.tolist()
        causal = tuple(window_size) == (-1, 0)
        parts = [torch.nn.functional.scaled_dot_product_attention(
            *(t[start:end].transpose(0, 1)[None] for t in (query, key, value)), is_causal=causal, scale=scale,
            enable_gqa=enable_gqa)[0].transpose(0, 1) for start, end in zip(bounds[:-1], bounds[1:], strict=True)]
        return torch.cat(parts)

    return varlen_attn


def _model(arch: str = "qwen2"):
    """test_packed_attention's small random model, attending through the varlen path."""
    register_packed_varlen()
    return packed_attention_model(PACKED_VARLEN, arch)


def _packed_equals_alone(model, sequences, positions) -> None:
    """The packed row's logits are each sequence's own (transformers' SDPA, one sequence at a time)."""
    packed = model(input_ids=torch.cat(sequences)[None], position_ids=positions).logits[0]
    model.config._attn_implementation = "sdpa"
    alone = torch.cat([model(input_ids=s[None]).logits[0] for s in sequences])
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-6)


def _packed():
    generator = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, 50, (n,), generator=generator) for n in LENGTHS]
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return sequences, positions, cu


def test_a_packed_row_through_the_kernel_gives_each_sequences_own_logits_and_gradients(monkeypatch):
    calls = []
    monkeypatch.setattr(varlen_attention, "varlen_kernel", lambda: stand_in_kernel(calls))
    monkeypatch.setattr(varlen_attention, "cuda_flash_takes", lambda query: True)  # CPU fp32 stands in for CUDA bf16
    model = _model()
    sequences, positions, cu = _packed()
    # As the trainer calls it: the micro-batch's own boundaries (MicroBatch.model_inputs)
    packed = model(input_ids=torch.cat(sequences)[None], position_ids=positions, cu_seq_lens_q=cu,
                   cu_seq_lens_k=cu, max_length_q=max(LENGTHS), max_length_k=max(LENGTHS)).logits[0]
    packed.square().mean().backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    assert len(calls) == 2  # one kernel call per layer for the whole row
    head_dim = 32 // 4
    assert calls[0] == {"cu": cu.tolist(), "max": (13, 13), "window": (-1, 0), "gqa": True, "heads": (4, 2),
                        "scale": head_dim**-0.5}

    model.zero_grad()
    model.config._attn_implementation = "sdpa"
    alone = torch.cat([model(input_ids=s[None]).logits[0] for s in sequences])
    alone.square().mean().backward()
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-6)
    for packed_grad, param in zip(packed_grads, model.parameters(), strict=True):
        torch.testing.assert_close(packed_grad, param.grad, rtol=1e-5, atol=1e-7)


def test_boundaries_come_from_the_positions_when_the_batch_has_none(monkeypatch):
    calls = []
    monkeypatch.setattr(varlen_attention, "varlen_kernel", lambda: stand_in_kernel(calls))
    monkeypatch.setattr(varlen_attention, "cuda_flash_takes", lambda query: True)
    sequences, positions, cu = _packed()
    _model()(input_ids=torch.cat(sequences)[None], position_ids=positions)
    assert calls[0]["cu"] == cu.tolist() and calls[0]["max"] == (13, 13)


def test_a_torch_without_enable_gqa_gets_repeated_key_value_heads(monkeypatch):
    calls = []
    newer = stand_in_kernel(calls)

    def torch_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        # torch 2.10's spelling: is_causal, no scale (its default, 1/sqrt(head_dim)), no grouped heads
        assert key.shape[1] == query.shape[1]
        return newer(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size=(-1, 0) if is_causal else (-1, -1))

    monkeypatch.setattr(varlen_attention, "varlen_kernel", lambda: torch_2_10)
    monkeypatch.setattr(varlen_attention, "cuda_flash_takes", lambda query: True)
    sequences, positions, _ = _packed()
    _packed_equals_alone(_model(), sequences, positions)
    assert calls[0]["heads"] == (4, 4) and calls[0]["window"] == (-1, 0) and not calls[0]["gqa"]


def test_the_kernels_keywords_follow_the_torch_version():
    def torch_2_10(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None):
        """torch 2.10's spelling: is_causal, no scale, no grouped heads"""

    assert kernel_arguments(torch_2_10, True, 8**-0.5, 8) == {"is_causal": True}  # its default scale
    assert kernel_arguments(torch_2_10, True, 0.3, 8) is None  # cannot: packed SDPA answers
    this_torch = varlen_attention.varlen_kernel()
    assert kernel_arguments(this_torch, True, 0.3, 8) == {"window_size": (-1, 0), "enable_gqa": True, "scale": 0.3}
    assert kernel_arguments(this_torch, False, None, 8) == {"window_size": (-1, 0), "scale": None}


def test_what_the_kernel_cannot_take_stays_packed_sdpa(monkeypatch):
    """On the CPU (and for fp32, or an odd head dimension) the kernel is never called: packed SDPA
    answers, exactly as the CPU twin always does."""
    def never():
        raise AssertionError("the varlen kernel was called")

    monkeypatch.setattr(varlen_attention, "varlen_kernel", never)
    sequences, positions, _ = _packed()
    _packed_equals_alone(_model(), sequences, positions)
    cpu = torch.zeros(1, 4, 3, 64)
    assert not cuda_flash_takes(cpu) and not cuda_flash_takes(cpu.bfloat16())
