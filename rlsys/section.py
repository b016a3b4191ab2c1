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


class SectionRegistry(dict):
    """Sections chosen by name in a config (`rollout.mode`, `algorithm.policy_loss`,
    `algorithm.corrections`): name -> section class, each registered by a class decorator under the
    default of its `key` field (a Literal of that one name), so that a module defining one is all
    it takes to add it."""

    def __init__(self, what: str, key: str):
        super().__init__()
        self.what, self.key = what, key

    def register(self, cls: type[Section]) -> type[Section]:
        """Class decorator: `cls` becomes the section named by its `key` field's default."""
        name = cls.model_fields[self.key].default
        if not isinstance(name, str) or not name:
            raise TypeError(f"{cls.__name__} needs `{self.key}: Literal[NAME] = NAME` to be registered")
        if name in self and self[name] is not cls:
            raise ValueError(f"{self.what} {name!r} is registered twice ({self[name].__name__}, {cls.__name__})")
        self[name] = cls
        return cls

    def as_written(self, value: object) -> object:
        """A config's value for such a section, a name read as {key: name}; anything else (a section,
        a dict, a value for pydantic to refuse) as it is."""
        return {self.key: value} if isinstance(value, str) else value
