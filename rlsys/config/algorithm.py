"""algorithm: the GRPO loss, its advantages, KL, corrections and shaping."""

from __future__ import annotations

import logging
from typing import Literal

from pydantic import Field, PrivateAttr, SerializeAsAny, field_validator, model_validator

from rlsys.algorithms.corrections import Correction, correction_named
from rlsys.algorithms.policy_losses import PolicyLoss, fold_flat_loss_keys, policy_loss_named
from rlsys.section import Section

logger = logging.getLogger(__name__)


class OverlongPenaltyConfig(Section):
    """DAPO's soft overlong punishment, added to the reward: 0 up to max_new_tokens - buffer_tokens,
    then falling linearly to -factor at max_new_tokens."""

    buffer_tokens: int = Field(ge=1, description="Length of the ramp before max_new_tokens, in tokens.")
    factor: float = Field(1.0, ge=0.0, description="The penalty at max_new_tokens.")


_OFF_POLICY_DEFAULT = "__off_policy_default__"


def _corrections_from_tis(values: dict) -> dict:
    """An algorithm section with the tis section of earlier versions -> the same with `corrections`,
    said as deprecated: tis {enabled: true, cap: C, level: L} is [{name: importance_sampling, level: L,
    max: C}], enabled: false is [], and without `enabled` it sets what an off-policy run gets."""
    values = dict(values)
    tis = values.pop("tis")
    if not isinstance(tis, dict):
        raise ValueError(f"tis must be a section {{enabled, cap, level}} (got {tis!r}); it is deprecated: write "
                         "corrections: [{name: importance_sampling, level: token, max: 2.0}]")
    unknown = set(tis) - {"enabled", "cap", "level"}
    if unknown:
        raise ValueError(f"tis has no field(s) {', '.join(sorted(unknown))} (enabled, cap, level); it is deprecated: "
                         "write corrections: [{name: importance_sampling, level: token, max: 2.0}]")
    if "corrections" in values:
        raise ValueError("tis and corrections are both set: set only corrections (tis is deprecated: "
                         "tis {enabled: true, cap: C, level: L} is corrections: [{name: importance_sampling, "
                         "level: L, max: C}])")
    section = {"name": "importance_sampling", **({"max": tis["cap"]} if "cap" in tis else {}),
               **({"level": tis["level"]} if "level" in tis else {})}
    enabled = tis.get("enabled")
    if enabled is True:
        values["corrections"] = [section]
    elif enabled is False:
        values["corrections"] = []
    else:
        values[_OFF_POLICY_DEFAULT] = section
    written = ", ".join(f"{key}: {value}" for key, value in section.items() if key != "name")
    logger.warning("algorithm.tis is deprecated: write algorithm.corrections: %s",
                   "[]" if enabled is False else f"[{{name: importance_sampling{', ' + written if written else ''}}}]"
                   + ("" if enabled else " (unset corrections: that, when the run is off-policy)"))
    return values


class AlgorithmConfig(Section):
    name: Literal["grpo"] = Field("grpo", description="The algorithm (GRPO only).")
    policy_loss: SerializeAsAny[PolicyLoss] = Field(
        default_factory=lambda: policy_loss_named("grpo"),
        description="The per-token policy loss: its name (grpo, the default), or a section of its name and its "
        "parameters ({name: cispo, max_ratio: 3.0}); each loss is a module of rlsys/algorithms/policy_losses/, "
        "computed as TRL 1.16 computes it. The losses and their parameters: the section below.",
    )
    clip_eps_low: float = Field(0.2, ge=0.0, description="PPO clip: the ratio is kept above 1 - clip_eps_low.")
    clip_eps_high: float = Field(
        0.2, ge=0.0, description="PPO clip: the ratio is kept below 1 + clip_eps_high (above clip_eps_low: "
        "DAPO's clip-higher).",
    )
    advantage_estimator: Literal["group", "batch", "none", "rloo", "reinforce++", "reinforce++-baseline"] = Field(
        "group", description="Advantage of each sample from its score (reward + shaping): minus its group's mean, "
        "divided by the group's score std (group, GRPO), the batch's score std (batch) or nothing (none, Dr. GRPO); "
        "minus the mean of the other samples of its group (rloo); minus the batch mean, over the batch std "
        "(reinforce++); minus its group's mean, then normalised over the batch (reinforce++-baseline). Formerly "
        "adv_norm (still accepted).",
    )
    loss_agg_mode: (Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
                    | None) = Field(
        None, description="How token losses add up to a mini-batch's loss: mean over all tokens; mean over "
        "sequences of each sequence's token mean; mean over sequences of token sums (LUSPO); or mean over sequences "
        "of token sums / loss_norm_tokens (Dr. GRPO). Unset: the policy loss's own (the table of policy losses), "
        "resolved at load.",
    )
    loss_norm_tokens: int | None = Field(
        None, ge=1, description="The constant of seq-mean-token-sum-norm; default rollout.max_new_tokens "
        "(resolved at load).",
    )
    use_kl_loss: bool = Field(False, description="KL to the frozen reference as a loss term.")
    kl_in_reward: bool = Field(False, description="Subtract kl_coef * sequence KL from the reward instead.")
    kl_coef: float = Field(0.0, ge=0.0, description="Weight of the KL term (needed > 0 when KL is on).")
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3", description="Per-token KL estimate: k1 = log p - log q, k2 = (log p - log q)^2 / 2, "
        "k3 = exp(log q - log p) - (log q - log p) - 1.",
    )
    entropy_coef: float = Field(0.0, ge=0.0, description="Entropy bonus: coef * entropy is subtracted from each "
                                "token's loss.")
    dynamic_sampling: bool = Field(
        False, description="DAPO: drop groups whose rewards are all equal (no gradient) and sample more prompts "
        "until the step has data.prompts_per_step groups or max_sampling_rounds is reached.",
    )
    max_sampling_rounds: int = Field(
        4, ge=1, description="Generation rounds per step with dynamic_sampling; then the step trains on what it has.",
    )
    mask_truncated: bool = Field(
        False, description="A response cut off by max_new_tokens contributes no loss (its reward still counts in "
        "its group's advantages).",
    )
    overlong_penalty: OverlongPenaltyConfig | None = Field(
        None, description="DAPO's soft overlong punishment (off when unset).",
    )
    corrections: list[SerializeAsAny[Correction]] | None = Field(
        None, description="Rollout corrections against the engine/trainer mismatch, applied together (their factors "
        "multiply each token's policy loss): a list of names or sections ({name: importance_sampling, level: "
        "sequence, mode: mask, min: 0.5, max: 2.0}), each a module of rlsys/algorithms/corrections/; the table below. "
        "Unset: [importance_sampling] (token-level, truncated at 2: TIS) when the run is off-policy "
        "(its rollout.mode is: async, partial), else none; resolved at load, as "
        "RUN_DIR/config.yaml shows. Replaces tis: {enabled, cap, level} (still read).",
    )
    # What `corrections` resolves to on an off-policy run when unset: a deprecated tis section without
    # `enabled` (tis: {cap: 3}) changes it.
    _off_policy_default: dict = PrivateAttr(default_factory=lambda: {"name": "importance_sampling"})

    @field_validator("policy_loss", mode="before")
    @classmethod
    def _named_loss(cls, value):
        return policy_loss_named(value)

    @field_validator("corrections", mode="before")
    @classmethod
    def _named_corrections(cls, value):
        if isinstance(value, (str, dict)):
            value = [value]
        return [correction_named(item) for item in value] if isinstance(value, list) else value

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, values):
        if isinstance(values, dict):
            values = fold_flat_loss_keys(values)
        if isinstance(values, dict) and "normalize_adv_by_std" in values:
            raise ValueError("normalize_adv_by_std was replaced by advantage_estimator: true -> "
                             "advantage_estimator: group, false -> advantage_estimator: none")
        if isinstance(values, dict) and "adv_norm" in values:
            # Renamed once RLOO and REINFORCE++ made it more than a normalisation; same values.
            if "advantage_estimator" in values:
                raise ValueError("adv_norm was renamed advantage_estimator; set only advantage_estimator")
            values = {**values}
            values["advantage_estimator"] = values.pop("adv_norm")
        return values

    @model_validator(mode="wrap")
    @classmethod
    def _off_policy_default_from_tis(cls, values, handler):
        default = None
        if isinstance(values, dict) and "tis" in values:  # (the before-validators run inside handler)
            values = _corrections_from_tis(values)
            default = values.pop(_OFF_POLICY_DEFAULT, None)
        section = handler(values)
        if default is not None:
            section._off_policy_default = default
        return section

    @model_validator(mode="after")
    def _kl(self):
        if self.use_kl_loss and self.kl_in_reward:
            raise ValueError("use_kl_loss and kl_in_reward are alternatives; set only one")
        if (self.use_kl_loss or self.kl_in_reward) and self.kl_coef == 0.0:
            raise ValueError("KL is on (use_kl_loss or kl_in_reward) but kl_coef is 0; set kl_coef > 0")
        return self

    @property
    def aggregation(self) -> str:
        """loss_agg_mode, or when unset the policy loss's own (TRL's pairing)."""
        return self.loss_agg_mode or self.policy_loss.aggregation

    def resolved(self, max_new_tokens: int, off_policy: bool) -> AlgorithmConfig:
        """This section with its defaults that depend on the rollout filled in (what set is kept):
        loss_agg_mode the policy loss's own, loss_norm_tokens `max_new_tokens`, corrections TIS exactly
        when the run is `off_policy` (samples from earlier weights, which TIS reweighs). Idempotent."""
        corrections = self.corrections
        if corrections is None:
            corrections = [correction_named(dict(self._off_policy_default))] if off_policy else []
        return self.model_copy(update={"loss_agg_mode": self.aggregation,
                                       "loss_norm_tokens": self.loss_norm_tokens or max_new_tokens,
                                       "corrections": corrections})

    @model_validator(mode="after")
    def _policy_loss_fits(self):
        self.policy_loss.check(self)
        return self
