"""rollout: generation by the SGLang engines (how many, what they sample, in which mode)."""

from __future__ import annotations

import logging
from typing import Literal

from pydantic import Field, SerializeAsAny, field_validator, model_validator

from rlsys.config.engine import EngineConfig, SamplingConfig
from rlsys.config.rollout_modes import RolloutMode, SyncMode, fold_old_mode_keys, rollout_mode_named
from rlsys.section import Section

logger = logging.getLogger(__name__)

# Names of standing engine sets (`rlsys engines up --name`): Ray actor names; "/" joins a set's name to its engines'.
STANDING_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"


class RolloutConfig(Section):
    num_engines: int = Field(1, ge=1, description="SGLang engines (colocated: at most trainer.num_ranks).")
    n_samples_per_prompt: int = Field(8, description="GRPO group size.")
    temperature: float = Field(
        1.0, gt=0.0, description="Sampling temperature of training rollouts (the trainer's log-probs use it too).",
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling: sample from this probability mass.")
    max_new_tokens: int = Field(32, ge=1, description="Longest response, in tokens.")
    stop: list[str] = Field(
        default_factory=list, description="Strings that end a response (with engine.skip_tokenizer_init: "
        "single-token ones only).",
    )
    sampling: SamplingConfig = Field(
        default_factory=SamplingConfig, description="Further SGLang sampling parameters.",
    )
    engine: EngineConfig = Field(default_factory=EngineConfig, description="The SGLang servers.")
    attach: str | None = Field(
        None, pattern=STANDING_NAME_PATTERN,
        description="Use the standing engines of this name (`rlsys engines up CONFIG --name NAME`, in the Ray "
        "cluster at placement.ray_address, or this machine's) instead of starting engines: checked against this run's "
        "model and placement, leased to one run at a time, given the run's weights at start, left running at the end. "
        "Their engine settings are the ones they were started with.",
    )
    generate_function: str | None = Field(
        None, description="An async function (path/to/file.py:fn or package.module:fn) that builds one sample: "
        "it may call the engine several times and run tools in between (rlsys.rollout.trajectory). "
        "Default: one engine call per sample.",
    )
    tool_timeout_s: float = Field(30.0, gt=0.0, description="A tool call running longer ends its trajectory.")

    mode: SerializeAsAny[RolloutMode] = Field(
        default_factory=SyncMode,
        description="When a step's samples are generated and from which weights: its type (sync, the default), or "
        "a section of its type and parameters ({type: partial, oversample: 8}); each mode is a section of "
        "rlsys/config/rollout_modes.py with its runner in rlsys/run/rollout_modes/. The modes and their parameters: "
        "the section below. Replaces max_staleness (async) and partial_rollouts, oversample, partial_max_age "
        "(partial), still read.",
    )
    routing_replay: Literal["off", "rollout"] = Field(
        "off", description="Mixture-of-experts models. rollout: the engines return the experts they routed each token "
        "to (SGLang's --enable-return-routed-experts) and every trainer forward of the sample (old log-probs, "
        "reference, policy) routes each token of each MoE layer by them, its gating weights the trainer's own router "
        "probabilities over those experts (R3, as verl, slime and NeMo-RL replay); a continued partial rollout keeps "
        "the routes its tokens were sampled with. routing_mismatch_fraction: the share of (token, layer) pairs whose "
        "trainer top-k differs from the engine's. off: each side routes by itself.",
    )

    def uses_radix_cache(self, has_gpu: bool) -> bool:
        """Whether the engines keep SGLang's prefix cache (rollout.engine.radix_cache, or its default)."""
        if self.engine.radix_cache is not None:
            return self.engine.radix_cache
        return has_gpu or self.generate_function is not None

    @field_validator("generate_function")
    @classmethod
    def _import_path(cls, value):
        if value is not None and (":" not in value or not value.rpartition(":")[0] or not value.rpartition(":")[2]):
            raise ValueError(f"{value!r} must look like 'path/to/file.py:function' or 'package.module:function'")
        return value

    @field_validator("mode", mode="before")
    @classmethod
    def _named_mode(cls, value):
        return rollout_mode_named(value)

    @model_validator(mode="before")
    @classmethod
    def _old_mode_keys(cls, values):
        return fold_old_mode_keys(values, logger.warning) if isinstance(values, dict) else values

    @model_validator(mode="after")
    def _routing_replay_fits(self):
        if self.routing_replay != "off" and self.generate_function:
            raise ValueError("rollout.routing_replay replays the routes of single engine calls; a "
                             "rollout.generate_function's trajectories (several turns, injected tool output) are not "
                             "supported yet: turn one off")
        return self

    @model_validator(mode="after")
    def _group_size(self):
        if self.n_samples_per_prompt < 2:
            raise ValueError(
                f"n_samples_per_prompt must be >= 2 for GRPO (got {self.n_samples_per_prompt})"
            )
        if self.sampling.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"rollout.sampling.min_new_tokens ({self.sampling.min_new_tokens}) exceeds max_new_tokens "
                f"({self.max_new_tokens})"
            )
        if self.sampling.min_new_tokens and self.engine.skip_tokenizer_init:
            raise ValueError(
                "rollout.sampling.min_new_tokens needs the engine's tokenizer (SGLang ignores it with "
                "rollout.engine.skip_tokenizer_init); use rollout.sampling.ignore_eos for fixed-length responses"
            )
        return self
