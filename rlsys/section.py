"""The base of every config section (rlsys/config.py's sections and the policy losses' own
parameters, rlsys/algorithms/policy_losses/): unknown fields refused, no inf or NaN, no true/false
where a number is meant. Its own module so that a section defined outside config.py needs no import
of config.py."""

from __future__ import annotations

import types
import typing
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


class Section(BaseModel):
    # allow_inf_nan=False: no float setting of a run means anything at inf or NaN (lr, temperature,
    # coefficients, timeouts: "no limit" is spelled null where a field allows it).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value, info: ValidationInfo):
        # Pydantic's lax mode reads true/false as 1/0 (trainer.total_steps=true would run 1 step).
        # Strict mode would refuse them, but also "1e-5", which YAML leaves a string.
        if _bool_where_number(cls.model_fields[info.field_name].annotation, value):
            shown = yaml.safe_dump(value, default_flow_style=True).splitlines()[0]  # as YAML spells it
            raise ValueError(f"expects a number, not true/false (got {shown})")
        return value


def _bool_where_number(annotation, value) -> bool:
    """Whether `value` holds a bool where `annotation` wants an int or a float (also inside
    lists, tuples, dicts and unions)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return not any(_accepts(arg, value) for arg in args) and any(_bool_where_number(a, value) for a in args)
    if isinstance(value, bool):
        if origin is Literal:
            return not any(arg is value for arg in args) and any(type(arg) in (int, float) for arg in args)
        return annotation in (int, float)
    if origin in (list, tuple) and isinstance(value, (list, tuple)) and args:
        return any(_bool_where_number(args[0] if origin is list or args[-1] is Ellipsis else args[min(i, len(args) - 1)],
                                      item) for i, item in enumerate(value))
    if origin is dict and isinstance(value, dict) and len(args) == 2:
        return any(_bool_where_number(args[1], item) for item in value.values())
    return False


def _accepts(annotation, value) -> bool:
    """A union member that takes a bool as it is (a bool field, or a Literal of True/False)."""
    return isinstance(value, bool) and (annotation is bool or (
        typing.get_origin(annotation) is Literal and any(arg is value for arg in typing.get_args(annotation))))
