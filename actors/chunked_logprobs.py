"""Token log-probs and entropy from the last hidden states, a chunk of tokens at a time.

logits = (h @ W.T + b) / T;  log p(y) = logits_y - logsumexp(logits);  H = -sum_v p_v log p_v.
Plain autograd keeps the [tokens, vocab] logits, log-softmax and softmax alive for backward (at
16k tokens x 152k vocabulary, ~10 GB per fp32 copy). `target_logprobs` keeps only h, W, the
targets and two floats per token, and recomputes each chunk's logits in backward:
  d log p(y) / d logits = (onehot(y) - p) / T;   dH / d logits = -p * (log p + H) / T.
"""

from __future__ import annotations

import torch


def _compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """fp32 for 16-bit inputs (and fp32), fp64 for fp64 (gradcheck)."""
    return torch.promote_types(tensor.dtype, torch.float32)


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  temperature: float) -> torch.Tensor:
    """One chunk's logits in fp32 (fp64 for fp64). The matmul runs in the inputs' dtype, as the
    model's own lm_head would (a bf16 weight is never copied to fp32 whole)."""
    logits = (hidden @ weight.T).to(_compute_dtype(hidden))
    if bias is not None:
        logits += bias
    return logits.div_(temperature)


class _ChunkedTargetLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_tokens, with_entropy):
        flat_hidden = hidden.reshape(-1, hidden.shape[-1])
        flat_targets = targets.reshape(-1)
        logprobs = torch.empty(flat_targets.shape, dtype=_compute_dtype(hidden), device=hidden.device)
        entropy = torch.empty_like(logprobs) if with_entropy else None
        logsumexp = torch.empty_like(logprobs)
        for start in range(0, flat_targets.numel(), chunk_tokens):
            end = min(start + chunk_tokens, flat_targets.numel())
            logits = _chunk_logits(flat_hidden[start:end], weight, bias, temperature)
            lse = torch.logsumexp(logits, dim=-1)
            logsumexp[start:end] = lse
            logprobs[start:end] = logits.gather(-1, flat_targets[start:end, None]).squeeze(-1) - lse
            if with_entropy:  # H = lse - sum_v p_v * logits_v
                probs = (logits - lse[:, None]).exp_()
                entropy[start:end] = lse - probs.mul_(logits).sum(-1)
                del probs
        ctx.save_for_backward(hidden, weight, bias, targets, logsumexp, entropy)
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        shape = targets.shape
        return logprobs.view(shape), (entropy.view(shape) if with_entropy else None)

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, targets, logsumexp, entropy = ctx.saved_tensors
        temperature, chunk_tokens = ctx.temperature, ctx.chunk_tokens
        flat_hidden = hidden.reshape(-1, hidden.shape[-1])
        flat_targets = targets.reshape(-1)
        dtype = _compute_dtype(hidden)
        g_lp = grad_logprobs.reshape(-1).to(dtype) if grad_logprobs is not None else None
        g_h = grad_entropy.reshape(-1).to(dtype) if grad_entropy is not None and entropy is not None else None
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        grad_hidden = torch.empty_like(flat_hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=dtype, device=bias.device) if need_bias else None
        for start in range(0, flat_targets.numel(), chunk_tokens):
            end = min(start + chunk_tokens, flat_targets.numel())
            # At most two [chunk, vocab] tensors at a time: log p (reused for the gradient) and p.
            log_probs = _chunk_logits(flat_hidden[start:end], weight, bias, temperature)
            log_probs -= logsumexp[start:end, None]
            probs = log_probs.exp()
            if g_h is not None:  # dH/dlogits = -p * (log p + H)
                grad_logits = log_probs.add_(entropy.reshape(-1)[start:end, None]).mul_(probs)
                grad_logits.mul_(-g_h[start:end, None])
            else:
                grad_logits = log_probs.zero_()
            if g_lp is not None:  # d log p(y)/dlogits = onehot(y) - p
                grad_logits -= probs.mul_(g_lp[start:end, None])
                grad_logits.scatter_add_(-1, flat_targets[start:end, None], g_lp[start:end, None])
            del probs
            grad_logits /= temperature
            chunk_grad = grad_logits.to(weight.dtype)
            if need_hidden:
                grad_hidden[start:end] = (chunk_grad @ weight).to(hidden.dtype)
            if need_weight:
                grad_weight += (chunk_grad.T @ flat_hidden[start:end].to(weight.dtype)).to(dtype)
            if need_bias:
                grad_bias += grad_logits.sum(0)
        return (grad_hidden.view(hidden.shape) if need_hidden else None,
                grad_weight.to(weight.dtype) if need_weight else None,
                grad_bias.to(bias.dtype) if need_bias else None,
                None, None, None, None)


def target_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                    chunk_tokens: int, with_entropy: bool, bias: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 log p(target) per token of softmax((hidden @ weight.T + bias) / temperature), and the
    entropy of that distribution when `with_entropy`; `chunk_tokens` tokens at a time, forward and
    backward. Shapes: hidden [..., H], weight [V, H], targets [...] -> [...]."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    return _ChunkedTargetLogProbs.apply(hidden, weight, bias, targets, temperature, chunk_tokens, with_entropy)


def target_logprobs_reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                              temperature: float, with_entropy: bool, bias: torch.Tensor | None = None,
                              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The same values by plain autograd over full-vocabulary logits (tests, comparisons)."""
    logits = _chunk_logits(hidden, weight, bias, temperature)
    log_probs = torch.log_softmax(logits, dim=-1)
    target = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1) if with_entropy else None
    return target, entropy
