"""How reward functions are loaded and called.

The one signature every reward function has:

    def reward(prompt: str, response: str, label: str, metadata: dict) -> float

`response` is the generated text decoded with special tokens kept and cut at the first
end-of-sequence token (so an `<eos>` sampled mid-answer is not silently dropped). Functions are
named in config by import path, `package.module:function` (importable, or in the working
directory), or by file, `path/to/file.py:function`. A function that raises, or returns
something that is not a finite number, makes that sample's group a counted skip.
"""

from __future__ import annotations

import importlib
import inspect
import math
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from rlsys.system.working_dir import working_directory

RewardFn = Callable[[str, str, str, dict], float]


class RewardFunctionError(ValueError):
    """A configured user function (reward.function, rollout.generate_function) cannot be loaded
    or has the wrong signature."""


def load_user_function(import_path: str, field: str) -> Callable:
    """`package.module:function` (importable, or a module in the working directory) or
    `path/to/file.py:function` (relative to the working directory); errors name `field`."""
    module_name, sep, attribute = import_path.rpartition(":")
    if not sep or not module_name or not attribute:
        raise RewardFunctionError(
            f"{field} {import_path!r} must look like 'package.module:function' or 'path/to/file.py:function'"
        )
    if module_name.endswith(".py"):
        module = _module_from_file(Path(module_name), field)
    else:
        module = _import_module(module_name, field)
    function = getattr(module, attribute, None)
    if not callable(function):
        raise RewardFunctionError(f"{field}: {module_name!r} has no callable {attribute!r}")
    return function


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


def _import_module(module_name: str, field: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name.split(".")[0] or working_directory() in sys.path:
            raise RewardFunctionError(f"{field}: cannot import module {module_name!r}: {error}") from error
    except Exception as error:  # the module exists but raised while importing
        raise RewardFunctionError(f"{field}: importing {module_name!r} failed: {error!r}") from error
    # `python -m` puts the working directory on the path; the `rlsys` script does not. Look there
    # too, so a module next to the config works however rlsys is started.
    sys.path.insert(0, working_directory())
    return _import_module(module_name, field)


def _module_from_file(path: Path, field: str) -> ModuleType:
    path = path.expanduser().resolve()
    if not path.is_file():
        raise RewardFunctionError(f"{field}: no such file {str(path)!r}")
    if path.stem in sys.stdlib_module_names:
        # Its folder goes first on the import path, where the file would stand in for that module
        # (a reward worker's own start-up imports it, and breaks).
        raise RewardFunctionError(f"{field}: the file {path.name!r} has the name of Python's standard-library "
                                  f"module {path.stem!r}, which it would hide; rename the file")
    # Its own folder goes on the import path (as `python path/to/file.py` would put it), so the
    # file can import modules beside it, at load time or later inside the function.
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    # One module object per file: a file that holds both the reward and the generate function
    # is executed once per process.
    name = f"rlsys_user_{path.stem}_{abs(hash(str(path))):x}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        raise RewardFunctionError(f"{field}: loading {str(path)!r} failed: {error!r}") from error
    sys.modules[name] = module
    return module


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
