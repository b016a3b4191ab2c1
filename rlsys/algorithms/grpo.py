"""GRPO as pure tensor functions: group advantages, the PPO-clipped token loss, KL estimators.

Shapes: per-token tensors are [batch, tokens] with a 0/1 `mask` marking response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


# A_i = (r_i - mean(r_group)) / (std(r_group) + eps); a group whose rewards are all equal gets 0.
def group_advantages(
    rewards: torch.Tensor, group_size: int, normalize_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Rewards [num_groups * group_size] laid out group by group -> one advantage per sample."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.float().view(-1, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_by_std:
        std = grouped.std(dim=1, keepdim=True, unbiased=True)
        centered = centered / (std + eps)
    return centered.view(-1)


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


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum()


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution at every position: -sum p log p."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)
