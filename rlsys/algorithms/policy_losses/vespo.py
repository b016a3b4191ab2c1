"""vespo: each response's tokens weighed by a detached gamma function of its sequence ratio."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field

from rlsys.algorithms.policy_losses.base import PolicyLoss, register_policy_loss


# L = -sg(phi(w_i)) * A * log p,  log w_i = sum_t clamp(log r_t, -20, 20) [+ sum_t clamp(log is_t, log 1e-8, 20)]
# (TRL 1.16: loss_type="vespo", get_gamma_weights; the importance weights (algorithm.corrections of kind
# "weight") go into w_i instead of multiplying L)
@register_policy_loss
class Vespo(PolicyLoss):
    name: Literal["vespo"] = Field("vespo", description="The loss.")
    k_pos: float = Field(2.0, ge=0.0, description="phi's power k where A >= 0 (down-weights w < 1).")
    lambda_pos: float = Field(3.0, gt=0.0, description="phi's decay lambda where A >= 0 (down-weights w > 1).")
    k_neg: float = Field(3.0, ge=0.0, description="phi's power k where A < 0.")
    lambda_neg: float = Field(2.0, gt=0.0, description="phi's decay lambda where A < 0.")
    summary = ("-sg(phi(w)) A log p, w the response's ratio (product of its token ratios, times its token "
               "importance weights), phi(w) = exp(lambda + k log w - lambda w); own aggregation token-mean")
    whole_sequence = True

    def check(self, algorithm) -> None:
        whole = [c.name for c in algorithm.corrections or [] if c.kind == "weight" and c.whole_sequence()]
        if whole:
            raise ValueError("policy_loss vespo folds the importance weights into its sequence weight token by token; "
                             f"correction(s) {', '.join(whole)} weigh whole sequences: use level: token")

    def terms(self, logprobs, old_logprobs, batch, algorithm, tis):
        import torch

        from rlsys.algorithms.grpo import PolicyLossTerms, sequence_reduce

        log_ratio = torch.clamp(logprobs.detach() - old_logprobs, -20.0, 20.0)
        if tis is not None:
            log_ratio = log_ratio + torch.clamp(torch.log(tis.weights), math.log(1e-8), 20.0)
        phi = self.weights(sequence_reduce(log_ratio, batch.response_mask, batch.spans, mean=False),
                           batch.advantages)
        return PolicyLossTerms(loss=-phi * batch.advantages * logprobs, clipped=torch.zeros_like(phi),
                               tis_applied=True, weight=phi)

    # phi(w) = exp(lam + k * log w - lam * w), (k, lam) = (k_pos, lambda_pos) if A >= 0 else the _neg
    # pair; phi(1) = 1.
    def weights(self, log_ratio_sum, advantages):
        """log w [B, T] of each token's sequence (already clamped per token) -> phi [B, T], detached.
        log w is clamped to [log 1e-8, 20] and a non-finite phi is 0, as TRL does."""
        import torch

        with torch.no_grad():
            log_w = torch.clamp(log_ratio_sum, math.log(1e-8), 20.0)
            nonneg = advantages >= 0
            k = torch.where(nonneg, self.k_pos, self.k_neg)
            lam = torch.where(nonneg, self.lambda_pos, self.lambda_neg).clamp(min=1e-4)
            return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)

    def weight_metrics(self, mean_weight: float) -> dict[str, float]:
        return {"vespo_phi_mean": mean_weight}
