"""grpo: PPO's clip of each token's ratio (the default)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlsys.algorithms.policy_losses.base import PolicyLoss, register_policy_loss


# L = max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high)),  r = exp(log p - log p_old)
# (TRL 1.16: loss_type="grpo"/"dapo"/..., importance_sampling_level="token", delta=None)
@register_policy_loss
class Grpo(PolicyLoss):
    name: Literal["grpo"] = Field("grpo", description="The loss.")
    summary = ("PPO clip of each token's ratio r: max(-A r, -A clip(r, 1 - clip_eps_low, 1 + clip_eps_high)); "
               "own aggregation token-mean")

    def terms(self, logprobs, old_logprobs, batch, algorithm, tis):
        from rlsys.algorithms.grpo import clipped_policy_loss

        return clipped_policy_loss(logprobs, old_logprobs, batch.advantages, algorithm.clip_eps_low,
                                   algorithm.clip_eps_high)
