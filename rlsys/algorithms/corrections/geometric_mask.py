"""Geometric-mean sequence mask (verl's rollout rejection sampling at the "geometric" level,
docs/algo/rollout_corr_math.md section 3.3.3; Liu, Li et al., "When Speed Kills Stability"): a
response is kept when exp(mean_t log rho_t), the geometric mean of its token ratios, lies in
[low, high], and dropped whole otherwise. Unlike the product of the ratios it does not grow with the
response's length, so its bounds are tight (verl: 1.0001-1.001 over ~1e3-token responses)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from rlsys.algorithms.corrections.base import Correction, CorrectionInputs, CorrectionTerms, register_correction


@register_correction
class GeometricMask(Correction):
    name: Literal["geometric_mask"] = Field("geometric_mask", description="The correction.")
    low: float | None = Field(None, ge=0.0, description="Lowest kept geometric mean (none: 1 / high).")
    high: float = Field(1.001, gt=0.0, description="Highest kept geometric mean.")

    summary: ClassVar[str] = "drops a response whose geometric-mean ratio exp(mean_t log rho_t) is outside [low, high]"
    kind: ClassVar[str] = "mask"

    def whole_sequence(self) -> bool:
        return True

    @property
    def lower(self) -> float:
        return self.low if self.low is not None else 1.0 / self.high

    def check(self) -> None:
        if self.lower > self.high:
            raise ValueError(f"geometric_mask: low {self.lower} is above high {self.high}")

    def terms(self, inputs: CorrectionInputs) -> CorrectionTerms:
        import torch

        geometric = torch.exp(inputs.per_sequence(inputs.log_rho, inputs.engine_mask, mean=True))
        rejected = ((geometric < self.lower) | (geometric > self.high)).float() * inputs.response_mask
        return CorrectionTerms(factor=1.0 - rejected, masked=rejected, truncated=torch.zeros_like(rejected))
