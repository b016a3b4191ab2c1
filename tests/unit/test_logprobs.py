"""Chunked token log-probs and entropy equal plain autograd's, values and gradients, without
keeping full-vocabulary tensors for backward.

Both sides round in fp32 but sum in different orders (a chunk's matmul blocks differently from
the whole batch's), so they agree to the rounding bound of a length-H dot product and a
logsumexp, not bit for bit: |delta| <= c * eps * H * max|h|.|w| (c = 4 covers the dot product,
the temperature division and the logsumexp)."""

import pytest
import torch

from rlsys.actors.chunked_logprobs import target_logprobs, target_logprobs_reference


def _inputs(batch=2, seq=7, hidden=16, vocab=50, dtype=torch.float32, bias=False, seed=0):
    generator = torch.Generator().manual_seed(seed)
    h = torch.randn(batch, seq, hidden, generator=generator, dtype=dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=generator, dtype=dtype) * 0.5).requires_grad_()
    b = (torch.randn(vocab, generator=generator, dtype=dtype) * 0.1).requires_grad_() if bias else None
    targets = torch.randint(0, vocab, (batch, seq), generator=generator)
    return h, w, b, targets


@pytest.mark.parametrize("chunk", [1, 4, 14, 100])  # one token, uneven, exact, more than all
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_values_equal_plain_autograd(chunk, bias, temperature):
    h, w, b, targets = _inputs(bias=bias)
    logprobs, entropy = target_logprobs(h, w, targets, temperature, chunk, True, bias=b)
    expected_lp, expected_entropy = target_logprobs_reference(h, w, targets, temperature, True, bias=b)
    assert logprobs.dtype == torch.float32 and logprobs.shape == targets.shape
    bound = _rounding_bound(h, w, temperature)
    assert bound < 1e-3  # a real bound, not a blanket tolerance
    torch.testing.assert_close(logprobs, expected_lp, atol=bound, rtol=0)
    torch.testing.assert_close(entropy, expected_entropy, atol=bound, rtol=0)


def _rounding_bound(h, w, temperature):
    """fp32 rounding bound of a logit (and so of log p and H): 4 * eps * H * max_{t,v} |h_t|.|w_v| / T."""
    magnitudes = h.detach().abs().reshape(-1, h.shape[-1]) @ w.detach().abs().T
    return 4 * torch.finfo(torch.float32).eps * h.shape[-1] * magnitudes.max().item() / temperature


def _grads(fn, loss_of, bias):
    h, w, b, targets = _inputs(bias=bias, seed=1)
    loss_of(*fn(h, w, targets, b)).backward()
    return [t.grad for t in (h, w, b) if t is not None]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("loss", ["logprobs and entropy", "logprobs only", "entropy computed, unused",
                                  "entropy only"])
def test_gradients_equal_plain_autograd(bias, loss):
    generator = torch.Generator().manual_seed(2)
    w1, w2 = torch.randn(2, 7, generator=generator), torch.randn(2, 7, generator=generator)
    with_entropy = loss != "logprobs only"
    losses = {
        "logprobs and entropy": lambda lp, ent: (lp * w1).sum() + 0.01 * (ent * w2).sum(),
        "logprobs only": lambda lp, ent: (lp * w1).sum(),
        "entropy computed, unused": lambda lp, ent: (lp * w1).sum(),
        "entropy only": lambda lp, ent: (ent * w2).sum(),
    }

    def chunked(h, w, targets, b):
        return target_logprobs(h, w, targets, 0.8, 3, with_entropy, bias=b)

    def reference(h, w, targets, b):
        return target_logprobs_reference(h, w, targets, 0.8, with_entropy, bias=b)

    h, w, _, _ = _inputs(bias=bias, seed=1)
    bound = _rounding_bound(h, w, 0.8)
    for got, expected in zip(_grads(chunked, losses[loss], bias), _grads(reference, losses[loss], bias), strict=True):
        # gradients are sums of (p - onehot) * upstream over tokens or vocabulary: the logit bound
        # scaled by the largest such sum
        scale = expected.abs().max().item()
        torch.testing.assert_close(got, expected, atol=bound * max(scale, 1.0), rtol=0)


def test_gradcheck_in_float64():
    h, w, b, targets = _inputs(batch=1, seq=5, hidden=4, vocab=9, dtype=torch.float64, bias=True)
    assert torch.autograd.gradcheck(
        lambda h, w, b: target_logprobs(h, w, targets, 0.7, 2, True, bias=b), (h, w, b))


def test_bf16_inputs_give_fp32_values_and_grads_of_their_own_dtype():
    h, w, _, targets = _inputs(dtype=torch.bfloat16)
    logprobs, entropy = target_logprobs(h, w, targets, 1.0, 4, True)
    assert logprobs.dtype == entropy.dtype == torch.float32
    (logprobs.sum() + entropy.sum()).backward()
    assert h.grad.dtype == w.grad.dtype == torch.bfloat16
    expected, _ = target_logprobs_reference(h.detach().float(), w.detach().float(), targets, 1.0, False)
    torch.testing.assert_close(logprobs, expected, atol=5e-2, rtol=0)  # bf16 matmul, fp32 softmax


def test_chunk_size_must_be_positive():
    h, w, _, targets = _inputs()
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        target_logprobs(h, w, targets, 1.0, 0, False)



def test_the_trainers_chunked_log_probs_equal_its_unchunked_path(tiny_model_dir):
    """Through the real model and its LogProbHead: chunked (7 tokens at a time) and unchunked
    log-probs of the same sequences agree to a few fp32 ulps of their magnitude."""
    import random

    from rlsys.actors.trainer import TrainerWorker
    from rlsys.records import TrainSequence
    from tests.helpers import trainer_spec

    rng = random.Random(0)
    sequences = [TrainSequence([rng.randrange(3, 80) for _ in range(40)], prompt_len=8) for _ in range(6)]
    results = {}
    for chunk in (7, 0):
        worker = TrainerWorker(trainer_spec(tiny_model_dir, num_ranks=1, logprob_chunk_tokens=chunk), 0, 1)
        worker.setup(*worker.rendezvous_address())
        try:
            results[chunk] = torch.tensor([lp for row in worker.compute_log_probs(sequences) for lp in row])
        finally:
            worker.shutdown()
    bound = 4 * torch.finfo(torch.float32).eps * results[0].abs().max().item()  # 4 ulps of the largest
    assert (results[7] - results[0]).abs().max().item() <= bound
