"""How reward functions are loaded and called.

The one signature every reward function has:

    def reward(prompt: str, response: str, label: str, metadata: dict) -> float

`response` is the generated text cut at the first end-of-sequence token and decoded without
special tokens (reward.skip_special_tokens, as TRL, verl and slime decode a completion for their
reward functions; false keeps them, so a `<pad>` sampled mid-answer stays in the text). Functions are
named in config by import path, `package.module:function` (importable, or in the working
directory), or by file, `path/to/file.py:function`. A function that raises, or returns
something that is not a finite number, makes that sample's group a counted skip.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

from rlsys.plugins import PluginError, load_user_function

RewardFn = Callable[[str, str, str, dict], float]


class RewardFunctionError(PluginError):
    """A reward function (reward.function, an eval set's reward_function) with the wrong signature."""


def load_reward_function(import_path: str, field: str = "reward.function") -> RewardFn:
    """The reward function at `import_path`; errors name the config `field` it came from."""
    function = load_user_function(import_path, field)
    try:
        inspect.signature(function).bind("prompt", "response", "label", {})
    except TypeError as error:
        raise RewardFunctionError(
            f"{field} {import_path!r} must accept (prompt, response, label, metadata): {error}"
        ) from error
    return function


# The largest reward magnitude taken. Advantages and the loss are computed in float32 (largest
# number 3.4e38): a group-centred advantage is up to 2|r|, summed over up to ~1e6 loss tokens with
# weights <= 1, so |r| <= 1e30 keeps every term finite with room to spare; squares for the std (done
# in float64, up to 1.8e308) stay finite too. Beyond it a reward is an error, counted like NaN.
REWARD_MAGNITUDE_LIMIT = 1e30


def reward_value_problem(value) -> str | None:
    """Why `value` cannot be a reward (None: it can): not a number, not finite, or too large."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "not a number"
    if not math.isfinite(value):
        return "not a finite number"
    if abs(value) > REWARD_MAGNITUDE_LIMIT:
        return f"larger in magnitude than {REWARD_MAGNITUDE_LIMIT:g} (advantages and the loss are float32)"
    return None


def score(function: RewardFn, prompt: str, response: str, label: str, metadata: dict) -> float:
    """Call a reward function; raises ValueError if what it returns cannot be a reward."""
    value = function(prompt, response, label, metadata)
    problem = reward_value_problem(value)
    if problem is not None:
        raise ValueError(f"reward function returned {value!r}: {problem}; it must return a finite number "
                         f"within +-{REWARD_MAGNITUDE_LIMIT:g}")
    return float(value)
