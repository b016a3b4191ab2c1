"""rollout.mode: when a step's samples are generated and from which weights, one pydantic section
per mode keyed on `type` (`rollout.mode: partial`, or `{type: partial, oversample: 8}`).

A mode is two pieces: its config variant here (a `RolloutMode` subclass registered with
`@register_rollout_mode`: its parameters, what it changes for the rest of the run, what it
refuses) and its runner in rlsys/run/rollout_modes/ (how it makes the run's batches). Adding one
is those two and a test; the config, the loop and docs/configuration.md pick it up with no other
edit. No run code here: the config is read before anything starts, also where Ray is absent.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Protocol

from pydantic import Field

from rlsys.section import Section, SectionRegistry


class RunSettings(Protocol):
    """What a mode reads of the run's config to check that it fits (rlsys/config/run.py RunConfig,
    which imports this module: the mode names the sections, not the class)."""

    rollout: Any
    data: Any
    placement: Any


class RolloutMode(Section):
    """One rollout mode: its parameters (the pydantic fields of a subclass) and what it brings to
    the rest of the run (class attributes)."""

    type: str = Field(description="The mode.")

    summary: ClassVar[str] = ""  # one line for the configuration reference
    # What the rest of the run must know of it (the rules that read these: rlsys/config/rules.py):
    off_policy: ClassVar[bool] = False  # samples may come from older weights: corrections default to TIS
    overlaps_training: ClassVar[bool] = False  # engines generate while trainers train: their own devices
    takes_images: ClassVar[bool] = True  # its requests can carry a prompt's images
    takes_generate_function: ClassVar[bool] = True  # it can build samples with rollout.generate_function
    why_not: ClassVar[str] = ""  # what it does that the refused combinations above cannot follow

    def check(self, config: RunSettings) -> None:
        """Raise ValueError naming what to change when the rest of `config` does not fit this mode."""


ROLLOUT_MODES = SectionRegistry("rollout mode", "type")
register_rollout_mode = ROLLOUT_MODES.register  # class decorator: `cls` becomes `rollout.mode: TYPE`


def rollout_mode_named(value: Any) -> Any:
    """A config's rollout.mode (a type name, or a section with its `type`) -> that mode's section.
    Anything else is returned as it is, for pydantic to refuse."""
    value = ROLLOUT_MODES.as_written(value)
    if not isinstance(value, dict):
        return value
    name = value.get("type")
    if name not in ROLLOUT_MODES:
        raise ValueError(f"rollout.mode type {name!r} is not one of {', '.join(ROLLOUT_MODES)}"
                         if name is not None else f"rollout.mode needs its type ({', '.join(ROLLOUT_MODES)})")
    return ROLLOUT_MODES[name].model_validate(value)


@register_rollout_mode
class SyncMode(RolloutMode):
    type: Literal["sync"] = Field("sync", description="The mode.")
    summary = ("Each step's batch is generated at the step's start, every sample from the weights the trainer "
               "just synced (on-policy); the step waits for its slowest sample")


@register_rollout_mode
class AsyncMode(RolloutMode):
    type: Literal["async"] = Field("async", description="The mode.")
    max_staleness: int = Field(
        1, ge=1, description="The engines generate up to this many steps' batches ahead while the trainer trains, "
        "so a sample is at most this many weight versions older than the trainer (a group with an older sample is "
        "dropped and counted); 1 is one-step off-policy.",
    )
    summary = ("The next steps' batches are generated in the background while the trainer trains (asynchronous, "
               "off-policy by at most max_staleness weight versions); needs placement.mode disaggregated")
    off_policy = True
    overlaps_training = True


@register_rollout_mode
class PartialMode(RolloutMode):
    type: Literal["partial"] = Field("partial", description="The mode.")
    oversample: int | None = Field(
        None, ge=0, description="Groups in flight beyond data.prompts_per_step, so a step need not wait for its "
        "slowest group. Default: a quarter of data.prompts_per_step, at least 1.",
    )
    max_age: int | None = Field(
        None, ge=1, description="A sample holding a token more than this many weight versions old starts again "
        "from its prompt (the tokens thrown away are counted). Default: no bound.",
    )
    summary = ("A step stops generating once data.prompts_per_step groups are finished and aborts the rest on the "
               "engines; their samples keep their tokens and log-probs and are continued at the next step with the "
               "weights then current (each token keeps the weight version that sampled it; TIS is on by default)")
    off_policy = True
    takes_images = False
    takes_generate_function = False
    why_not = "it aborts requests and continues them from their token ids"

    def groups_in_flight(self, prompts_per_step: int) -> int:
        """prompts_per_step plus oversample (or its default)."""
        extra = self.oversample if self.oversample is not None else max(1, prompts_per_step // 4)
        return prompts_per_step + extra


# The keys of earlier versions, each now a mode's: rollout.KEY -> (mode type, its field).
OLD_MODE_KEYS = {"max_staleness": ("async", "max_staleness"), "partial_rollouts": ("partial", None),
                 "oversample": ("partial", "oversample"), "partial_max_age": ("partial", "max_age")}


def fold_old_mode_keys(values: dict, warn) -> dict:
    """A rollout section with the mode keys of earlier versions (max_staleness: N, partial_rollouts,
    oversample, partial_max_age) -> the same with `mode`, `warn` called with the line that says how
    to write it now. Refused: old keys beside `mode`, or keys of two modes."""
    old = {key: values[key] for key in OLD_MODE_KEYS if key in values}
    if not old:
        return values
    values = {key: value for key, value in values.items() if key not in OLD_MODE_KEYS}
    # null is how a config.yaml of those versions wrote an unset oversample or partial_max_age
    set_keys = {key: value for key, value in old.items() if value is not None}
    if "mode" in values:
        raise ValueError(f"rollout.{', rollout.'.join(old)} and rollout.mode are both set: set only rollout.mode "
                         "(the others are deprecated)")
    partial = old.get("partial_rollouts") is True
    staleness = old.get("max_staleness") or 0
    if not partial and ("oversample" in set_keys or "partial_max_age" in set_keys):
        named = "rollout.oversample" if "oversample" in set_keys else "rollout.partial_max_age"
        raise ValueError(f"{named} applies to partial rollouts only: set rollout.partial_rollouts=true too "
                         "(deprecated; now rollout.mode: {type: partial, ...})")
    if partial and staleness:
        raise ValueError(f"rollout.partial_rollouts and rollout.max_staleness={staleness} are two ways of not "
                         "waiting for the slowest samples; choose one (now rollout.mode: partial or async)")
    if partial:
        mode = {"type": "partial", **{OLD_MODE_KEYS[key][1]: set_keys[key] for key in ("oversample", "partial_max_age")
                                      if key in set_keys}}
    elif staleness:
        mode = {"type": "async", "max_staleness": staleness}
    else:
        mode = {"type": "sync"}
    written = ", ".join(f"{key}: {value}" for key, value in mode.items())
    warn(f"rollout.{', rollout.'.join(old)} {'is' if len(old) == 1 else 'are'} deprecated: write "
         f"rollout.mode: {{{written}}}")
    if mode["type"] != "sync":
        values["mode"] = mode
    return values
