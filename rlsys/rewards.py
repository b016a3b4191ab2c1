"""Reward functions and how they are loaded.

The one signature every reward function has:

    def reward(prompt: str, response: str, label: str, metadata: dict) -> float

`response` is the generated text decoded with special tokens kept and cut at the first
end-of-sequence token (so an `<eos>` sampled mid-answer is not silently dropped). Functions are
named in config by import path, `package.module:function`. A function that raises, or returns
something that is not a finite number, makes that sample's group a counted skip.
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
from collections.abc import Callable

RewardFn = Callable[[str, str, str, dict], float]


class RewardFunctionError(ValueError):
    """The configured reward function cannot be loaded or has the wrong signature."""


def load_reward_function(import_path: str) -> RewardFn:
    module_name, sep, attribute = import_path.partition(":")
    if not sep or not module_name or not attribute:
        raise RewardFunctionError(
            f"reward.function {import_path!r} must look like 'package.module:function'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise RewardFunctionError(f"reward.function: cannot import module {module_name!r}: {error}") from error
    function = getattr(module, attribute, None)
    if not callable(function):
        raise RewardFunctionError(f"reward.function: {module_name!r} has no callable {attribute!r}")
    try:
        inspect.signature(function).bind("prompt", "response", "label", {})
    except TypeError as error:
        raise RewardFunctionError(
            f"reward.function {import_path!r} must accept (prompt, response, label, metadata): {error}"
        ) from error
    return function


def score(function: RewardFn, prompt: str, response: str, label: str, metadata: dict) -> float:
    """Call a reward function; raises ValueError if it returns a non-finite or non-numeric value."""
    value = function(prompt, response, label, metadata)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"reward function returned {value!r}; it must return a finite number")
    return float(value)


# ---- built-in rule rewards -------------------------------------------------------------------

def exact_match(prompt: str, response: str, label: str, metadata: dict) -> float:
    """1.0 when the response, stripped of surrounding whitespace, equals the label."""
    return 1.0 if response.strip() == label.strip() else 0.0


def contains_label(prompt: str, response: str, label: str, metadata: dict) -> float:
    """1.0 when the label appears anywhere in the response."""
    return 1.0 if label.strip() and label.strip() in response else 0.0


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number_match(prompt: str, response: str, label: str, metadata: dict) -> float:
    """1.0 when the last number in the response equals the label numerically (GSM8K style)."""
    numbers = _NUMBER.findall(response)
    if not numbers:
        return 0.0
    try:
        return 1.0 if math.isclose(float(numbers[-1]), float(label), rel_tol=0, abs_tol=1e-6) else 0.0
    except ValueError:
        return 0.0
