"""The per-micro-batch loss and its parts, registered by name: policy losses (algorithm.policy_loss)
and loss aggregations (algorithm.loss_agg_mode; unset: the policy loss's own, `aggregation`). The
trainer calls `micro_batch_loss` and nothing else of the objective; TrainerGroup calls
`sequence_loss_weights` for each global mini-batch.

Shapes: per-token tensors are [B, T-1], B rows of a micro-batch (one when packed), position t
predicting token t + 1 (actors/batching.py `MicroBatch`). Adding a policy loss or an aggregation:
a function here and its registry entry (and its name in the config's Literal).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rlsys.algorithms.grpo import (
    ImportanceWeights,
    PolicyLossTerms,
    cispo_loss,
    clipped_policy_loss,
    kl_estimate,
    masked_sum,
    sapo_loss,
    sequence_reduce,
    truncated_importance_weights,
    vespo_weights,
)
from rlsys.config import AlgorithmConfig

if TYPE_CHECKING:  # the trainer's layout of a micro-batch; only its tensors are read here
    from rlsys.actors.batching import MicroBatch


# Each policy loss: (log p, log p_old [B, T], the micro-batch (advantages, response_mask, spans),
# algorithm, TIS weights or None) -> per-token loss and flags. A loss that sets `tis_applied`
# has used the TIS weights itself; otherwise micro_batch_loss multiplies them in. Each matches
# TRL 1.16's GRPOTrainer._compute_loss for its loss_type (named below), before aggregation.

# L = max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high)),  r = exp(log p - log p_old)
# (TRL: loss_type="grpo"/"dapo"/..., importance_sampling_level="token", delta=None)
def grpo_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, batch: MicroBatch,
                     algorithm: AlgorithmConfig, tis: ImportanceWeights | None) -> PolicyLossTerms:
    """logprobs, old_logprobs [B, T] -> per-token loss and clip flags [B, T]."""
    return clipped_policy_loss(logprobs, old_logprobs, batch.advantages, algorithm.clip_eps_low,
                               algorithm.clip_eps_high)


# L = max(-A * s_i, -A * clip(s_i, 1 - eps_low, 1 + eps_high)),  s_i = exp(mean_t (log p - log p_old)) over i
# (TRL: importance_sampling_level="sequence" with loss_type="grpo" (GSPO) or "luspo")
def gspo_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, batch: MicroBatch,
                     algorithm: AlgorithmConfig, tis: ImportanceWeights | None) -> PolicyLossTerms:
    """One ratio per sequence, the geometric mean of its token ratios over its loss tokens, on
    each of its tokens; a clipped sequence has every token flagged."""
    log_s = sequence_reduce(logprobs - old_logprobs, batch.response_mask, batch.spans, mean=True)
    return clipped_policy_loss(log_s, torch.zeros_like(log_s), batch.advantages, algorithm.clip_eps_low,
                               algorithm.clip_eps_high)


# L = -sg(min(r, cispo_max_ratio)) * A * log p   (TRL: loss_type="cispo", epsilon_high the cap)
def cispo_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, batch: MicroBatch,
                      algorithm: AlgorithmConfig, tis: ImportanceWeights | None) -> PolicyLossTerms:
    return cispo_loss(logprobs, old_logprobs, batch.advantages, algorithm.cispo_max_ratio)


# L = -A * (4 / tau) * sigmoid(tau * (r - 1)), tau by the sign of A   (TRL: loss_type="sapo")
def sapo_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, batch: MicroBatch,
                     algorithm: AlgorithmConfig, tis: ImportanceWeights | None) -> PolicyLossTerms:
    return sapo_loss(logprobs, old_logprobs, batch.advantages, algorithm.sapo_temperature_pos,
                     algorithm.sapo_temperature_neg)


# L = -sg(phi(w_i)) * A * log p,  log w_i = sum_t clamp(log r_t, -20, 20) [+ sum_t clamp(log tis_t, log 1e-8, 20)]
# (TRL: loss_type="vespo", get_gamma_weights; the TIS weights go into w_i instead of multiplying L)
def vespo_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, batch: MicroBatch,
                      algorithm: AlgorithmConfig, tis: ImportanceWeights | None) -> PolicyLossTerms:
    mask = batch.response_mask
    log_ratio = torch.clamp(logprobs.detach() - old_logprobs, -20.0, 20.0)
    if tis is not None:
        log_ratio = log_ratio + torch.clamp(torch.log(tis.weights), math.log(1e-8), 20.0)
    log_w = sequence_reduce(log_ratio, mask, batch.spans, mean=False)
    phi = vespo_weights(log_w, batch.advantages, algorithm.vespo_k_pos, algorithm.vespo_lambda_pos,
                        algorithm.vespo_k_neg, algorithm.vespo_lambda_neg)
    return PolicyLossTerms(loss=-phi * batch.advantages * logprobs, clipped=torch.zeros_like(phi),
                           tis_applied=True, weight=phi)


# Losses with one ratio per sequence: their clip fraction is also logged per sequence.
SEQUENCE_RATIO_LOSSES = ("gspo", "luspo")


def flagged_sequences(flags: torch.Tensor, mask: torch.Tensor, spans: list[tuple[int, int, int]]) -> tuple[int, int]:
    """flags, mask [B, T] -> (sequences with a loss token, those with a flagged loss token)."""
    spans = [span for span in spans if span[2] > span[1]]
    if not spans:
        return 0, 0
    at = ([row for row, _, _ in spans], [first for _, first, _ in spans])  # each sequence's sum sits on its span
    tokens = sequence_reduce(mask, mask, spans, mean=False)[at]
    flagged = sequence_reduce(flags, mask, spans, mean=False)[at]
    return int((tokens > 0).sum()), int(((flagged > 0) & (tokens > 0)).sum())


PolicyLoss = Callable[[torch.Tensor, torch.Tensor, "MicroBatch", AlgorithmConfig, "ImportanceWeights | None"],
                      PolicyLossTerms]
POLICY_LOSSES: dict[str, PolicyLoss] = {
    "grpo": grpo_policy_loss,
    "gspo": gspo_policy_loss,
    "luspo": gspo_policy_loss,  # GSPO's loss; what differs is its aggregation (seq-mean-token-sum)
    "cispo": cispo_policy_loss,
    "sapo": sapo_policy_loss,
    "vespo": vespo_policy_loss,
}


# How a mini-batch's token losses l_it add up to its loss: sum_i w_i * sum_t l_it, over the loss
# tokens (n_i of them in sequence i) of the N sequences that have any. Each aggregation gives w_i
# of one sequence with n_i > 0 from n_i, the counts of all N (`counted`) and norm_tokens. The
# weights depend on the whole mini-batch only, so any split over ranks and micro-batches gives
# the same gradient.

# w_i = 1 / sum_j n_j   (every token counts the same)
def token_mean(n: int, counted: list[int], norm_tokens: int | None) -> float:
    """n_i, [N] loss-token counts -> w_i (a float)."""
    return 1.0 / sum(counted)


# w_i = 1 / (N * n_i)   (every sequence counts the same)
def seq_mean_token_mean(n: int, counted: list[int], norm_tokens: int | None) -> float:
    """n_i, [N] loss-token counts -> w_i (a float)."""
    return 1.0 / (len(counted) * n)


# w_i = 1 / N   (LUSPO: each sequence's token sum, so a longer sequence weighs more)
def seq_mean_token_sum(n: int, counted: list[int], norm_tokens: int | None) -> float:
    """n_i, [N] loss-token counts -> w_i (a float)."""
    return 1.0 / len(counted)


# w_i = 1 / (N * norm_tokens)   (Dr. GRPO: no length bias)
def seq_mean_token_sum_norm(n: int, counted: list[int], norm_tokens: int | None) -> float:
    """n_i, [N] loss-token counts, the constant norm_tokens -> w_i (a float)."""
    return 1.0 / (len(counted) * norm_tokens)


LossAggregation = Callable[[int, list[int], "int | None"], float]
LOSS_AGGREGATIONS: dict[str, LossAggregation] = {
    "token-mean": token_mean,
    "seq-mean-token-mean": seq_mean_token_mean,
    "seq-mean-token-sum": seq_mean_token_sum,
    "seq-mean-token-sum-norm": seq_mean_token_sum_norm,
}


def sequence_loss_weights(loss_tokens: list[int], mode: str, norm_tokens: int | None = None) -> list[float]:
    """w_i for each sequence of one mini-batch, from its number of loss tokens n_i (0: no loss)."""
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r} (one of {', '.join(LOSS_AGGREGATIONS)})")
    if mode == "seq-mean-token-sum-norm" and not (norm_tokens and norm_tokens > 0):
        raise ValueError(f"seq-mean-token-sum-norm needs norm_tokens > 0 (got {norm_tokens})")
    counted = [n for n in loss_tokens if n > 0]
    weight = LOSS_AGGREGATIONS[mode]
    return [weight(n, counted, norm_tokens) if n > 0 else 0.0 for n in loss_tokens]


@dataclass
class MicroBatchLoss:
    objective: torch.Tensor  # scalar: sum over loss tokens of weight * token loss
    old_logprobs: torch.Tensor  # [B, T]
    kl: torch.Tensor  # [B, T] per-token KL estimate (0 without a reference)
    clipped: torch.Tensor  # [B, T] 1.0 where the policy loss took its clipped branch
    tis: ImportanceWeights | None
    weight: torch.Tensor | None = None  # [B, T] the policy loss's own per-token weight (VESPO's phi)


# L = sum_t w_t * (policy_loss_t * tis_t + kl_coef * KL_t - entropy_coef * H_t)
def micro_batch_loss(logprobs: torch.Tensor, entropy: torch.Tensor, batch: MicroBatch,
                     algorithm: AlgorithmConfig, tis: bool) -> MicroBatchLoss:
    """The objective of one micro-batch from the policy's log-probs and entropies [B, T]: the
    policy loss (times the TIS weights when `tis`), plus the KL loss and minus the entropy bonus
    when configured, each token weighed by `batch.loss_weights`, which are 0 outside the loss mask
    (prompt, injected tool output, masked responses): those tokens get exactly zero gradient.
    Without `batch.old_logprobs` (one mini-batch per step: the weights have not moved since the
    rollout) the old log-probs are the current ones, detached."""
    old_logprobs = batch.old_logprobs if batch.old_logprobs is not None else logprobs.detach()
    weights = None
    if tis:  # the samples came from the engine's distribution, not the trainer's
        weights = truncated_importance_weights(old_logprobs, batch.engine_logprobs, batch.engine_mask,
                                               algorithm.tis.cap, algorithm.tis.level, batch.spans)
    terms = POLICY_LOSSES[algorithm.policy_loss](logprobs, old_logprobs, batch, algorithm, weights)
    token_loss = terms.loss
    if weights is not None and not terms.tis_applied:
        token_loss = token_loss * weights.weights
    kl = torch.zeros_like(logprobs)
    if batch.ref_logprobs is not None:
        kl = kl_estimate(logprobs, batch.ref_logprobs, algorithm.kl_estimator)
        if algorithm.use_kl_loss:
            token_loss = token_loss + algorithm.kl_coef * kl
    if algorithm.entropy_coef:
        token_loss = token_loss - algorithm.entropy_coef * entropy
    # masked_sum multiplies: a token outside the mask adds 0 * (its loss), whose gradient is 0 as
    # long as the loss is finite there (it is: log-probs of real tokens, clipped ratios).
    return MicroBatchLoss(masked_sum(token_loss, batch.loss_weights), old_logprobs, kl, terms.clipped, weights,
                         terms.weight)
