"""The per-micro-batch loss and its parts: the policy loss (algorithm.policy_loss, one module each
in policy_losses/) and the loss aggregations, registered by name (algorithm.loss_agg_mode; unset:
the policy loss's own). The trainer calls `micro_batch_loss` and nothing else of the objective;
TrainerGroup calls `sequence_loss_weights` for each global mini-batch.

Shapes: per-token tensors are [B, T-1], B rows of a micro-batch (one when packed), position t
predicting token t + 1 (actors/batching.py `MicroBatch`). Adding an aggregation: a function here,
its registry entry and its name in the config's Literal; adding a policy loss: policy_losses/.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rlsys.algorithms.corrections import Correction, CorrectionInputs
from rlsys.algorithms.grpo import (
    ImportanceWeights,
    kl_estimate,
    masked_sum,
    sequence_reduce,
)
from rlsys.config import AlgorithmConfig

if TYPE_CHECKING:  # the trainer's layout of a micro-batch; only its tensors are read here
    from rlsys.actors.batching import MicroBatch


def flagged_sequences(flags: torch.Tensor, mask: torch.Tensor, spans: list[tuple[int, int, int]]
                      ) -> tuple[torch.Tensor | int, torch.Tensor | int]:
    """flags, mask [B, T] -> (sequences with a loss token, those with a flagged loss token), 0-dim
    tensors on their device (a step's sums are read from it once, `LossSums.all_reduced`)."""
    spans = [span for span in spans if span[2] > span[1]]
    if not spans:
        return 0, 0
    at = ([row for row, _, _ in spans], [first for _, first, _ in spans])  # each sequence's sum sits on its span
    tokens = sequence_reduce(mask, mask, spans, mean=False)[at]
    flagged = sequence_reduce(flags, mask, spans, mean=False)[at]
    return (tokens > 0).sum(), ((flagged > 0) & (tokens > 0)).sum()


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
class Corrected:
    """The corrections of a micro-batch, combined: `weights` goes to the policy loss (the product of
    the "weight" kind, None without any), `mask` multiplies its token loss (the product of the "mask"
    kind, None without any); `rejected` and `truncated` flag the tokens any of them dropped or cut."""

    weights: ImportanceWeights | None
    mask: torch.Tensor | None
    rejected: torch.Tensor
    truncated: torch.Tensor


def apply_corrections(corrections: list[Correction], logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                      batch: MicroBatch) -> Corrected:
    """Each of `corrections` (rlsys/algorithms/corrections/) on the micro-batch, combined."""
    inputs = CorrectionInputs(
        log_rho=(old_logprobs - batch.engine_logprobs) * batch.engine_mask, engine_mask=batch.engine_mask,
        response_mask=batch.response_mask, advantages=batch.advantages, logprobs=logprobs.detach(),
        sampling_logprobs=torch.where(batch.engine_mask > 0, batch.engine_logprobs, old_logprobs),
        spans=batch.spans)
    weight = mask = None
    rejected, truncated = torch.zeros_like(logprobs), torch.zeros_like(logprobs)
    for correction in corrections:
        terms = correction.terms(inputs)
        if correction.kind == "weight":
            weight = terms.factor if weight is None else weight * terms.factor
        else:
            mask = terms.factor if mask is None else mask * terms.factor
        rejected = torch.maximum(rejected, terms.masked)
        truncated = torch.maximum(truncated, terms.truncated)
    weights = None if weight is None else ImportanceWeights(weights=weight, clipped=truncated)
    return Corrected(weights, mask, rejected, truncated)


@dataclass
class MicroBatchLoss:
    objective: torch.Tensor  # scalar: sum over loss tokens of weight * token loss
    old_logprobs: torch.Tensor  # [B, T]
    kl: torch.Tensor  # [B, T] per-token KL estimate (0 without a reference)
    clipped: torch.Tensor  # [B, T] 1.0 where the policy loss took its clipped branch
    corrected: Corrected  # the rollout corrections' factors and flags
    weight: torch.Tensor | None = None  # [B, T] the policy loss's own per-token weight, if it has one

    @property
    def tis(self) -> ImportanceWeights | None:
        """The importance weights the policy loss received (None: no correction of kind "weight")."""
        return self.corrected.weights


# L = sum_t w_t * (policy_loss_t * is_t * mask_t + kl_coef * KL_t - entropy_coef * H_t)
def micro_batch_loss(logprobs: torch.Tensor, entropy: torch.Tensor, batch: MicroBatch,
                     algorithm: AlgorithmConfig) -> MicroBatchLoss:
    """The objective of one micro-batch from the policy's log-probs and entropies [B, T]: the
    policy loss (times its rollout corrections' factors, algorithm.corrections), plus the KL loss and
    minus the entropy bonus when configured, each token weighed by `batch.loss_weights`, which are 0
    outside the loss mask (prompt, injected tool output, masked responses): those tokens get exactly
    zero gradient. Without `batch.old_logprobs` (one mini-batch per step: the weights have not moved
    since the rollout) the old log-probs are the current ones, detached."""
    old_logprobs = batch.old_logprobs if batch.old_logprobs is not None else logprobs.detach()
    # the samples came from the engine's distribution, not the trainer's
    corrected = apply_corrections(algorithm.corrections or [], logprobs, old_logprobs, batch)
    weights = corrected.weights
    terms = algorithm.policy_loss.terms(logprobs, old_logprobs, batch, algorithm, weights)
    token_loss = terms.loss
    if weights is not None and not terms.tis_applied:
        token_loss = token_loss * weights.weights
    if corrected.mask is not None:
        token_loss = token_loss * corrected.mask
    kl = torch.zeros_like(logprobs)
    if batch.ref_logprobs is not None:
        kl = kl_estimate(logprobs, batch.ref_logprobs, algorithm.kl_estimator)
        if algorithm.use_kl_loss:
            token_loss = token_loss + algorithm.kl_coef * kl
    if algorithm.entropy_coef:
        token_loss = token_loss - algorithm.entropy_coef * entropy
    # masked_sum multiplies: a token outside the mask adds 0 * (its loss), whose gradient is 0 as
    # long as the loss is finite there (it is: log-probs of real tokens, clipped ratios).
    return MicroBatchLoss(masked_sum(token_loss, batch.loss_weights), old_logprobs, kl, terms.clipped, corrected,
                          terms.weight)
