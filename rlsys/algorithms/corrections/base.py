"""What a rollout correction is (`Correction`), the registry of them by name, and the reading of one
entry of `algorithm.corrections`: a name (`icepop`) or a section with its name and parameters
(`{name: importance_sampling, level: sequence, mode: mask, max: 2.0}`).

Every correction gives each response token a factor that multiplies its policy loss, from
rho_t = pi_trainer_old(y_t) / pi_engine(y_t) (the trainer's log-prob of the token under the weights
that sampled it, over the engine's). Two kinds:
- "weight": an importance weight (truncated or masked rho). The policy loss receives the product of
  the run's weights as its importance weights (a loss may fold them into its own ratio: VESPO).
- "mask": 0 or 1, multiplying the token loss after the policy loss, as TRL 1.16 applies its
  off-policy mask.
A masked token keeps its place in the loss's normaliser (TRL and verl do the same): the mask removes
its gradient, not its count.

No torch at import: config.py imports this to validate a config; `terms` imports torch.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from rlsys.section import Section, SectionRegistry

if TYPE_CHECKING:
    import torch


@dataclass
class CorrectionInputs:
    """A micro-batch's per-token tensors [B, T] as the corrections read them."""

    log_rho: torch.Tensor  # log pi_old - log pi_engine on tokens with an engine log-prob, 0 elsewhere
    engine_mask: torch.Tensor  # 1.0 on loss tokens with an engine log-prob
    response_mask: torch.Tensor  # 1.0 on the tokens the loss counts
    advantages: torch.Tensor
    logprobs: torch.Tensor  # the current policy's, detached
    sampling_logprobs: torch.Tensor  # the engine's where it gave one, else the old policy's
    spans: list[tuple[int, int, int]]  # per sequence: (row, first, end)

    def per_sequence(self, values: torch.Tensor, mask: torch.Tensor, mean: bool) -> torch.Tensor:
        """Each sequence's masked sum (or mean) of `values`, on each of its tokens."""
        from rlsys.algorithms.grpo import sequence_reduce

        return sequence_reduce(values, mask, self.spans, mean=mean)


@dataclass
class CorrectionTerms:
    factor: torch.Tensor  # [B, T] multiplies the token's policy loss (1 where nothing is corrected)
    masked: torch.Tensor  # [B, T] 1.0 where the factor is 0 because the token (or its sequence) was rejected
    truncated: torch.Tensor  # [B, T] 1.0 where a weight was cut to its bound


class Correction(Section):
    """One correction: its parameters (the pydantic fields of a subclass) and its factor (`terms`)."""

    name: str = Field(description="The correction.")

    summary: ClassVar[str] = ""  # one line for the configuration reference
    kind: ClassVar[Literal["weight", "mask"]] = "weight"

    def whole_sequence(self) -> bool:
        """Whether it needs sums over whole responses (context parallelism splits them over ranks)."""
        return False

    def check(self) -> None:
        """Raise ValueError naming what to change when the parameters do not fit together."""

    @abstractmethod  # pydantic's model metaclass is an ABCMeta: a correction without `terms` cannot be built
    def terms(self, inputs: CorrectionInputs) -> CorrectionTerms:
        """The per-token factor, and which tokens it rejected or truncated."""


CORRECTIONS = SectionRegistry("correction", "name")
# Class decorator: `cls` becomes `algorithm.corrections: [NAME]`, NAME the default of its `name` field.
register_correction = CORRECTIONS.register


def correction_named(value: object) -> object:
    """One entry of `algorithm.corrections` as written -> the registered correction (validated), or
    the value unchanged for pydantic to refuse."""
    value = CORRECTIONS.as_written(value)
    if not isinstance(value, dict):
        return value
    name = value.get("name")
    if name not in CORRECTIONS:
        raise ValueError(f"unknown correction {name!r} (one of {', '.join(CORRECTIONS)}); write "
                         "corrections: [NAME, {name: NAME, PARAMETER: VALUE}]")
    correction = CORRECTIONS[name].model_validate(value)
    correction.check()
    return correction
