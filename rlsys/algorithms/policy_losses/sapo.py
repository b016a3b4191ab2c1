"""sapo: a soft gate instead of PPO's clip (Qwen's Soft Adaptive Policy Optimization)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlsys.algorithms.policy_losses.base import PolicyLoss, register_policy_loss


# L = -A * (4 / tau) * sigmoid(tau * (r - 1)),  tau = temperature_pos if A > 0 else temperature_neg
# (TRL 1.16: loss_type="sapo")
@register_policy_loss
class Sapo(PolicyLoss):
    name: Literal["sapo"] = Field("sapo", description="The loss.")
    temperature_pos: float = Field(1.0, gt=0.0, description="The gate's temperature where A > 0.")
    temperature_neg: float = Field(1.05, gt=0.0, description="The gate's temperature where A <= 0.")
    summary = ("-A (4 / tau) sigmoid(tau (r - 1)), tau by the sign of A: a soft gate instead of the clip; own "
               "aggregation seq-mean-token-mean")
    aggregation = "seq-mean-token-mean"

    def terms(self, logprobs, old_logprobs, batch, algorithm, tis):
        """Its gradient at r is A * sech^2(tau (r - 1) / 2) * r * grad log p: 1 at r = 1, fading
        smoothly off-policy. Never clipped."""
        import torch

        from rlsys.algorithms.grpo import PolicyLossTerms

        ratio = torch.exp(logprobs - old_logprobs)
        tau = torch.where(batch.advantages > 0, self.temperature_pos, self.temperature_neg)
        gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
        return PolicyLossTerms(loss=-gate * batch.advantages, clipped=torch.zeros_like(ratio))
