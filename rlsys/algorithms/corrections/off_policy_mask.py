"""The off-policy sequence mask of the DeepSeek-V3.2 report, as TRL 1.16 computes it
(`GRPOTrainer.get_off_policy_mask`, `off_policy_mask_threshold`): a response with a negative
advantage whose mean over its tokens of log pi_sampling - log pi_theta (the current policy's,
detached) is above `threshold` is dropped; every other response is kept. A negative-advantage
sample the policy has moved far from teaches little and destabilises."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from rlsys.algorithms.corrections.base import Correction, CorrectionInputs, CorrectionTerms, register_correction


@register_correction
class OffPolicyMask(Correction):
    name: Literal["off_policy_mask"] = Field("off_policy_mask", description="The correction.")
    threshold: float = Field(description="Largest kept mean log-ratio of sampling over current policy.")

    summary: ClassVar[str] = ("drops a response with A < 0 and mean_t (log p_sampling - log p_theta) > threshold "
                              "(the engine's log-probs where it gave them)")
    kind: ClassVar[str] = "mask"

    def whole_sequence(self) -> bool:
        return True

    def terms(self, inputs: CorrectionInputs) -> CorrectionTerms:
        import torch

        divergence = inputs.per_sequence(inputs.sampling_logprobs - inputs.logprobs, inputs.response_mask, mean=True)
        rejected = ((inputs.advantages < 0) & (divergence > self.threshold)).float() * inputs.response_mask
        return CorrectionTerms(factor=1.0 - rejected, masked=rejected, truncated=torch.zeros_like(rejected))
