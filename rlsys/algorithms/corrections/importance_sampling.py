"""Importance sampling against the engine/trainer mismatch, TRL 1.16's four
`vllm_importance_sampling_mode`s (GRPOTrainer._generate_and_score_completions): the ratio per token,
or its product over the response (exp of the sum of log-ratios) on each of its tokens; then
truncated to [min, max] or set to 0 outside it. Truncated at token level with only `max` is TIS
(Yao et al., "Your efficient RL framework secretly brings you off-policy RL training")."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from rlsys.algorithms.corrections.base import Correction, CorrectionInputs, CorrectionTerms, register_correction


@register_correction
class ImportanceSampling(Correction):
    name: Literal["importance_sampling"] = Field("importance_sampling", description="The correction.")
    level: Literal["token", "sequence"] = Field(
        "token", description="token: one ratio per token; sequence: the product of a response's token ratios.")
    mode: Literal["truncate", "mask"] = Field(
        "truncate", description="truncate: the ratio clamped to [min, max]; mask: the ratio, 0 outside [min, max].")
    min: float | None = Field(None, ge=0.0, description="Lower bound of the ratio (none: no lower bound).")
    max: float | None = Field(2.0, gt=0.0, description="Upper bound of the ratio (none: no upper bound).")

    summary: ClassVar[str] = ("rho = exp(log p_old - log p_engine) per token or per response; truncate: "
                              "clamp(rho, min, max); mask: rho inside [min, max], else 0")
    kind: ClassVar[str] = "weight"

    def whole_sequence(self) -> bool:
        return self.level == "sequence"

    def check(self) -> None:
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"importance_sampling: min {self.min} is above max {self.max}")

    def terms(self, inputs: CorrectionInputs) -> CorrectionTerms:
        import torch

        log_rho = inputs.log_rho
        if self.level == "sequence":
            log_rho = inputs.per_sequence(log_rho, inputs.engine_mask, mean=False) * inputs.engine_mask
        rho = torch.exp(log_rho)
        low = self.min if self.min is not None else -float("inf")
        high = self.max if self.max is not None else float("inf")
        outside = ((rho < low) | (rho > high)).float() * inputs.engine_mask
        if self.mode == "truncate":
            return CorrectionTerms(factor=torch.clamp(rho, min=low, max=high), masked=torch.zeros_like(rho),
                                   truncated=outside)
        return CorrectionTerms(factor=rho.masked_fill(outside.bool(), 0.0), masked=outside,
                               truncated=torch.zeros_like(rho))
