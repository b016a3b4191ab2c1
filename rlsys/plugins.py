"""User functions named in a config (reward.function, an eval set's reward_function,
rollout.generate_function): found by import path, `package.module:function` (importable, or a
module in the working directory), or by file, `path/to/file.py:function` (relative to the working
directory). What each kind of function must look like is checked where it is used
(rlsys/rewards/loading.py, rlsys/run/generation.py)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from rlsys.errors import UserError
from rlsys.system.working_dir import working_directory


class PluginError(UserError):
    """A configured user function cannot be loaded or has the wrong shape; the message names the
    config field it came from."""


def load_user_function(import_path: str, field: str) -> Callable:
    """`package.module:function` (importable, or a module in the working directory) or
    `path/to/file.py:function` (relative to the working directory); errors name `field`."""
    module_name, sep, attribute = import_path.rpartition(":")
    if not sep or not module_name or not attribute:
        raise PluginError(
            f"{field} {import_path!r} must look like 'package.module:function' or 'path/to/file.py:function'"
        )
    if module_name.endswith(".py"):
        module = _module_from_file(Path(module_name), field)
    else:
        module = _import_module(module_name, field)
    function = getattr(module, attribute, None)
    if not callable(function):
        raise PluginError(f"{field}: {module_name!r} has no callable {attribute!r}")
    return function


def _import_module(module_name: str, field: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name.split(".")[0] or working_directory() in sys.path:
            raise PluginError(f"{field}: cannot import module {module_name!r}: {error}") from error
    except Exception as error:  # the module exists but raised while importing
        raise PluginError(f"{field}: importing {module_name!r} failed: {error!r}") from error
    # `python -m` puts the working directory on the path; the `rlsys` script does not. Look there
    # too, so a module next to the config works however rlsys is started.
    sys.path.insert(0, working_directory())
    return _import_module(module_name, field)


def _module_from_file(path: Path, field: str) -> ModuleType:
    path = path.expanduser().resolve()
    if not path.is_file():
        raise PluginError(f"{field}: no such file {str(path)!r}")
    if path.stem in sys.stdlib_module_names:
        # Its folder goes first on the import path, where the file would stand in for that module
        # (a reward worker's own start-up imports it, and breaks).
        raise PluginError(f"{field}: the file {path.name!r} has the name of Python's standard-library "
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
        raise PluginError(f"{field}: loading {str(path)!r} failed: {error!r}") from error
    sys.modules[name] = module
    return module
