"""gspo and luspo: PPO's clip of one ratio per sequence, the geometric mean of its token ratios;
luspo is the same loss with each sequence's token sum (a longer sequence weighs more)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlsys.algorithms.policy_losses.base import PolicyLoss, register_policy_loss


# L = max(-A * s_i, -A * clip(s_i, 1 - eps_low, 1 + eps_high)),  s_i = exp(mean_t (log p - log p_old)) over i
# (TRL 1.16: importance_sampling_level="sequence" with loss_type="grpo" (GSPO) or "luspo")
@register_policy_loss
class Gspo(PolicyLoss):
    name: Literal["gspo"] = Field("gspo", description="The loss.")
    summary = ("PPO clip of one ratio per sequence, the geometric mean of its token ratios, on each of its tokens; "
               "own aggregation seq-mean-token-mean, the only one it takes")
    aggregation = "seq-mean-token-mean"
    one_ratio_per_sequence = True
    whole_sequence = True

    def check(self, algorithm) -> None:
        if algorithm.aggregation != self.aggregation:
            # One ratio per sequence: a token-weighted aggregation counts it once per token, so a
            # sequence weighs by its length (TRL warns the same); luspo is exactly gspo + token sums.
            raise ValueError(
                f"policy_loss {self.name} has one ratio per sequence and takes loss_agg_mode {self.aggregation} "
                f"(got {algorithm.loss_agg_mode}: it would weigh each sequence by its length"
                + ("; gspo with token sums is policy_loss luspo" if self.name == "gspo" else "")
                + f"); set loss_agg_mode: {self.aggregation} or leave it unset")

    def terms(self, logprobs, old_logprobs, batch, algorithm, tis):
        """One ratio per sequence, on each of its tokens; a clipped sequence has every token flagged."""
        import torch

        from rlsys.algorithms.grpo import clipped_policy_loss, sequence_reduce

        log_s = sequence_reduce(logprobs - old_logprobs, batch.response_mask, batch.spans, mean=True)
        return clipped_policy_loss(log_s, torch.zeros_like(log_s), batch.advantages, algorithm.clip_eps_low,
                                   algorithm.clip_eps_high)


@register_policy_loss
class Luspo(Gspo):
    name: Literal["luspo"] = Field("luspo", description="The loss.")
    summary = "gspo's loss with seq-mean-token-sum, the only aggregation it takes: each response weighs by its length"
    aggregation = "seq-mean-token-sum"
