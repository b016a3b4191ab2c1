"""GRPO as pure tensor functions: group advantages, the PPO-clipped token loss, KL estimators.

Shapes: per-token tensors are [batch, tokens] with a 0/1 `mask` marking response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# group: A_i = (r_i - mean(r_group)) / (std(r_group) + eps)   (GRPO; an all-equal group gets 0)
# batch: A_i = (r_i - mean(r_group)) / (std(r_batch) + eps)   (group baseline, batch scale)
# none:  A_i =  r_i - mean(r_group)                            (Dr. GRPO: no std scaling)
ADV_NORMS = ("group", "batch", "none")


def group_advantages(rewards: torch.Tensor, group_size: int, norm: str = "group", eps: float = 1e-6) -> torch.Tensor:
    """Rewards [num_groups * group_size] laid out group by group -> one advantage per sample."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.float().view(-1, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if norm == "group":
        centered = centered / (grouped.std(dim=1, keepdim=True, unbiased=True) + eps)
    elif norm == "batch":
        batch_std = grouped.std(unbiased=True) if grouped.numel() > 1 else torch.zeros(())
        centered = centered / (batch_std + eps)
    elif norm != "none":
        raise ValueError(f"unknown advantage normalisation {norm!r} (one of {', '.join(ADV_NORMS)})")
    return centered.view(-1)


# How a mini-batch's token losses l_it add up to its loss: sum_i w_i * sum_t l_it, over the loss
# tokens (n_i of them in sequence i) of the N sequences that have any:
#   token-mean               w_i = 1 / sum_j n_j            (every token counts the same)
#   seq-mean-token-mean      w_i = 1 / (N * n_i)            (every sequence counts the same)
#   seq-mean-token-sum-norm  w_i = 1 / (N * norm_tokens)    (Dr. GRPO: no length bias)
# The weights depend on the whole mini-batch only, so any split over ranks and micro-batches
# gives the same gradient.
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def sequence_loss_weights(loss_tokens: list[int], mode: str, norm_tokens: int | None = None) -> list[float]:
    """w_i for each sequence of one mini-batch, from its number of loss tokens n_i (0: no loss)."""
    counted = [n for n in loss_tokens if n > 0]
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation {mode!r} (one of {', '.join(LOSS_AGG_MODES)})")
    if mode == "seq-mean-token-sum-norm" and not (norm_tokens and norm_tokens > 0):
        raise ValueError(f"seq-mean-token-sum-norm needs norm_tokens > 0 (got {norm_tokens})")
    weights = []
    for n in loss_tokens:
        if n <= 0:
            weights.append(0.0)
        elif mode == "token-mean":
            weights.append(1.0 / sum(counted))
        elif mode == "seq-mean-token-mean":
            weights.append(1.0 / (len(counted) * n))
        else:
            weights.append(1.0 / (len(counted) * norm_tokens))
    return weights


# DAPO's soft overlong punishment: 0 up to max_new_tokens - buffer, then falling linearly to
# -factor at max_new_tokens.
def overlong_penalty(response_len: int, max_new_tokens: int, buffer_tokens: int, factor: float) -> float:
    over = response_len - (max_new_tokens - buffer_tokens)
    return -factor * min(over, buffer_tokens) / buffer_tokens if over > 0 else 0.0


@dataclass
class ImportanceWeights:
    weights: torch.Tensor  # min(rho, cap) per token; 1 where there is no engine log-prob
    clipped: torch.Tensor  # 1.0 where rho > cap


# Truncated importance sampling (TIS) for the engine/trainer mismatch: the samples come from the
# engine's distribution, the loss assumes the trainer's. rho = exp(old_trainer - engine) per token,
# or its product over the sequence (exp of the sum) at sequence level; min(rho, cap) multiplies
# the policy loss.
def truncated_importance_weights(
    old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, engine_mask: torch.Tensor, cap: float,
    level: str, spans: list[tuple[int, int, int]] | None = None,
) -> ImportanceWeights:
    """Per-token weights [B, T]; `spans` (row, first, end) mark each sequence for level=sequence."""
    log_rho = (old_logprobs - engine_logprobs) * engine_mask
    if level == "sequence":
        per_sequence = torch.zeros_like(log_rho)
        for row, first, end in spans or []:
            per_sequence[row, first:end] = log_rho[row, first:end].sum()
        log_rho = per_sequence * engine_mask
    elif level != "token":
        raise ValueError(f"unknown TIS level {level!r} (token or sequence)")
    rho = torch.exp(log_rho)
    return ImportanceWeights(weights=torch.clamp(rho, max=cap), clipped=(rho > cap).float() * engine_mask)


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
