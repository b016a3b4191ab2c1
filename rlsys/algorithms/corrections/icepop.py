"""IcePop (Ling team, "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale Thinking
Model", its IcePop section): each token's policy gradient is weighted by
M(rho_t) = rho_t if alpha <= rho_t <= beta, else 0, rho_t = pi_train(y_t) / pi_infer(y_t): a
two-sided token mask that drops the tokens whose probabilities the two engines disagree on most
(their paper: alpha 0.5, beta 5), keeping the ratio as the weight of the rest."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from rlsys.algorithms.corrections.base import Correction, CorrectionInputs, CorrectionTerms, register_correction


@register_correction
class IcePop(Correction):
    name: Literal["icepop"] = Field("icepop", description="The correction.")
    alpha: float = Field(0.5, ge=0.0, description="Lower bound of the kept ratios.")
    beta: float = Field(5.0, gt=0.0, description="Upper bound of the kept ratios.")

    summary: ClassVar[str] = "per token: rho if alpha <= rho <= beta, else 0 (a two-sided token mask keeping rho)"
    kind: ClassVar[str] = "weight"

    def check(self) -> None:
        if self.alpha > self.beta:
            raise ValueError(f"icepop: alpha {self.alpha} is above beta {self.beta}")

    def terms(self, inputs: CorrectionInputs) -> CorrectionTerms:
        import torch

        rho = torch.exp(inputs.log_rho)
        rejected = ((rho < self.alpha) | (rho > self.beta)).float() * inputs.engine_mask
        return CorrectionTerms(factor=rho * (1.0 - rejected), masked=rejected, truncated=torch.zeros_like(rho))
