"""GRPO's pure math: the PPO-clipped token loss, per-sequence reductions, KL estimators, truncated
importance weights and DAPO's overlong penalty, as functions of tensors and numbers (no config, no
records). The other policy losses are in policy_losses/, one module each.

Shapes: per-token tensors are [batch, tokens] with a 0/1 `mask` marking response tokens. The
registries that pick among them by config name are advantages.py, losses.py and policy_losses/.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


# DAPO's soft overlong punishment: 0 up to max_new_tokens - buffer, then falling linearly to
# -factor at max_new_tokens.
def overlong_penalty(response_len: int, max_new_tokens: int, buffer_tokens: int, factor: float) -> float:
    over = response_len - (max_new_tokens - buffer_tokens)
    return -factor * min(over, buffer_tokens) / buffer_tokens if over > 0 else 0.0


@dataclass
class ImportanceWeights:
    """The product of a micro-batch's rollout corrections of kind "weight" (rlsys/algorithms/corrections/)."""

    weights: torch.Tensor  # per token; 1 where there is no engine log-prob
    clipped: torch.Tensor  # 1.0 where a weight was truncated to its bound


# k1 = log p - log q;  k2 = (log p - log q)^2 / 2;  k3 = exp(log q - log p) - (log q - log p) - 1
def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled-token log-probs."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.exp(-log_ratio) + log_ratio - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r} (k1, k2 or k3)")


@dataclass
class PolicyLossTerms:
    """Per-token terms; callers reduce them with a mask and a normaliser of their choosing."""

    loss: torch.Tensor
    clipped: torch.Tensor  # 1.0 where the clipped branch of the objective was taken
    tis_applied: bool = False  # the loss used the TIS weights itself: the caller must not multiply them in
    weight: torch.Tensor | None = None  # the loss's own per-token weight, for its metrics (PolicyLoss.weight_metrics)


# L = max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high)),  r = exp(log p - log p_old)
def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps_low: float,
    clip_eps_high: float,
) -> PolicyLossTerms:
    """PPO-clipped surrogate per token; `advantages` is [batch, 1] or [batch, tokens]."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    return PolicyLossTerms(
        loss=torch.maximum(unclipped, clipped),
        clipped=(clipped > unclipped).float(),
    )


# Per sequence: sum_t m_t * x_t (or that over sum_t m_t), written on every position of its span.
# Packed rows hold several sequences, padded rows one; `spans` (row, first, end) say which, so
# both layouts give the same numbers. 0 outside every span.
def sequence_reduce(values: torch.Tensor, mask: torch.Tensor, spans: list[tuple[int, int, int]],
                    mean: bool) -> torch.Tensor:
    """values, mask [B, T] -> [B, T]: each sequence's masked sum (mean: masked mean) on its span."""
    out = torch.zeros_like(values)
    for row, first, end in spans:
        m = mask[row, first:end]
        total = (values[row, first:end] * m).sum()
        out[row, first:end] = total / m.sum().clamp(min=1.0) if mean else total
    return out


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum()

