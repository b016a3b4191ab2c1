"""cispo: the importance weight capped and detached, so a capped token still trains (MiniMax-M1)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlsys.algorithms.policy_losses.base import PolicyLoss, register_policy_loss


# L = -sg(min(r, max_ratio)) * A * log p,  r = exp(log p - log p_old)   (TRL 1.16: loss_type="cispo",
# epsilon_high the cap)
@register_policy_loss
class Cispo(PolicyLoss):
    name: Literal["cispo"] = Field("cispo", description="The loss.")
    max_ratio: float = Field(5.0, gt=0.0, description="The cap on the detached importance weight (TRL's "
                             "epsilon_high for cispo; ScaleRL's 5.0).")
    summary = "-sg(min(r, max_ratio)) A log p: a capped token still gets a gradient; own aggregation token-mean"

    def terms(self, logprobs, old_logprobs, batch, algorithm, tis):
        """Its gradient is min(r, max_ratio) * A * grad log p, so a capped token still trains (PPO's
        clip would zero it). clipped: r > max_ratio and A > 0."""
        import torch

        from rlsys.algorithms.grpo import PolicyLossTerms

        ratio = torch.exp(logprobs - old_logprobs)
        weight = torch.clamp(ratio, max=self.max_ratio).detach()
        return PolicyLossTerms(loss=-weight * batch.advantages * logprobs,
                               clipped=((ratio > self.max_ratio) & (batch.advantages > 0)).float())
