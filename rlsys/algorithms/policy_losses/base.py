"""What a policy loss is (`PolicyLoss`), the registry of them by name, and the reading of
`algorithm.policy_loss` from a config: a name (`cispo`), a section with its name and parameters
(`{name: cispo, max_ratio: 3.0}`), or the flat keys of earlier versions (`cispo_max_ratio`).

No torch here: config.py imports this to validate a config, and a loss imports torch only in
`terms`, when a trainer computes it.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from pydantic import Field

from rlsys.section import Section, SectionRegistry

if TYPE_CHECKING:
    import torch

    from rlsys.actors.batching import MicroBatch
    from rlsys.algorithms.grpo import ImportanceWeights, PolicyLossTerms

logger = logging.getLogger(__name__)


class AlgorithmSettings(Protocol):
    """What a loss reads of the algorithm section it belongs to (rlsys/config.py AlgorithmConfig,
    which imports this module: the loss names the fields, not the class)."""

    clip_eps_low: float
    clip_eps_high: float
    loss_agg_mode: str | None
    corrections: Any  # its rollout corrections (rlsys/algorithms/corrections/), None before resolution

    @property
    def aggregation(self) -> str: ...  # loss_agg_mode, or the loss's own


class PolicyLoss(Section):
    """One policy loss: its parameters (the pydantic fields of a subclass), what it brings to the
    rest of the run (class attributes) and its per-token computation (`terms`)."""

    name: str = Field(description="The loss.")

    summary: ClassVar[str] = ""  # one line for the configuration reference: its formula, what it does
    aggregation: ClassVar[str] = "token-mean"  # its own loss_agg_mode (TRL 1.16's pairing), used when unset
    one_ratio_per_sequence: ClassVar[bool] = False  # clips one ratio per sequence: seq_clip_fraction is logged
    whole_sequence: ClassVar[bool] = False  # needs sums over whole sequences (context parallelism splits them)

    def check(self, algorithm: AlgorithmSettings) -> None:
        """Raise ValueError naming what to change when the rest of `algorithm` does not fit this loss."""

    @abstractmethod  # pydantic's model metaclass is an ABCMeta: a loss without `terms` cannot be built
    def terms(self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, batch: MicroBatch,
              algorithm: AlgorithmSettings, tis: ImportanceWeights | None) -> PolicyLossTerms:
        """log p, log p_old [B, T], the micro-batch (advantages, response_mask, spans), the algorithm
        section and the importance weights of its corrections of kind "weight" (None: none) -> per-token
        loss and clip flags [B, T]. A loss that uses the weights itself sets `tis_applied`; otherwise they
        multiply its loss."""

    def weight_metrics(self, mean_weight: float) -> dict[str, float]:
        """Metrics from the mean over loss tokens of the per-token `weight` its terms return, if any."""
        return {}


POLICY_LOSSES = SectionRegistry("policy loss", "name")
# Class decorator: `cls` becomes `algorithm.policy_loss: NAME`, NAME the default of its `name` field.
register_policy_loss = POLICY_LOSSES.register


def policy_loss_named(value: object) -> object:
    """`algorithm.policy_loss` as written -> the registered loss's parameters (validated), or the
    value unchanged for pydantic to refuse."""
    value = POLICY_LOSSES.as_written(value)
    if not isinstance(value, dict):
        return value
    name = value.get("name")
    if name is None:  # e.g. algorithm.policy_loss.max_ratio=3 on the command line, over a config naming no loss
        given = ", ".join(f"{key}: {item!r}" for key, item in value.items())
        raise ValueError(f"policy_loss needs a name beside its parameters ({given}): write policy_loss: "
                         f"{{name: NAME, {given}}}, NAME one of {', '.join(POLICY_LOSSES)} "
                         "(on the command line, also algorithm.policy_loss.name=NAME)")
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r} (one of {', '.join(POLICY_LOSSES)}); write "
                         "policy_loss: NAME or policy_loss: {name: NAME, PARAMETER: VALUE}")
    return POLICY_LOSSES[name].model_validate(value)


def fold_flat_loss_keys(algorithm: dict) -> dict:
    """An algorithm section with the flat per-loss keys of earlier versions (`cispo_max_ratio: 5.0`:
    a loss's name, `_`, one of its parameters) -> the same with them inside `policy_loss`, each said
    as deprecated. A key of a loss the section does not use is dropped, as it had no effect; one
    that says otherwise than the nested form (a file's nested value, a command line's flat key) is
    refused: which of the two was meant cannot be known."""
    flat = {key: (name, key[len(name) + 1:]) for key in algorithm for name, cls in POLICY_LOSSES.items()
            if key.startswith(name + "_") and key[len(name) + 1:] in cls.model_fields.keys() - {"name"}}
    if not flat:
        return algorithm
    chosen = algorithm.get("policy_loss", "grpo")
    section = {"name": chosen} if isinstance(chosen, str) else dict(chosen) if isinstance(chosen, dict) else None
    folded = {key: value for key, value in algorithm.items() if key not in flat}
    for key, (name, parameter) in flat.items():
        used = section is not None and section.get("name") == name
        if used and parameter in section and section[parameter] != algorithm[key]:
            raise ValueError(f"algorithm.{key} is {algorithm[key]!r} but algorithm.policy_loss.{parameter} is "
                             f"{section[parameter]!r}: set one of them (algorithm.{key} is deprecated: write "
                             f"algorithm.policy_loss.{parameter})")
        if used:
            section.setdefault(parameter, algorithm[key])
        logger.warning("algorithm.%s is deprecated: write algorithm.policy_loss: {name: %s, %s: %s}%s", key, name,
                       parameter, algorithm[key], "" if used else
                       f" (ignored: the policy loss is {section.get('name') if section else chosen!r})")
    if section is not None:
        folded["policy_loss"] = section
    return folded
