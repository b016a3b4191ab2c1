"""rlsys: GRPO post-training on Ray, FSDP2 and SGLang.

`rlsys.actors`, `rlsys.rollout` and `rlsys.weight_sync` live in the repository's top-level folders
of those names; pyproject.toml maps them under this package when it is installed. A source tree
that is imported without being installed (e.g. uploaded as a Ray job's working_dir) registers
those three folders, and only them, under this package here, so both ways import the same files
and nothing else at the repository's top (tests/, bench/) becomes part of `rlsys`.
"""

import importlib.util
import sys
from pathlib import Path

_SOURCE_ROOT = Path(__file__).resolve().parent.parent
_MAPPED_FOLDERS = ("actors", "rollout", "weight_sync")


def _register_source_folders() -> None:
    for folder in _MAPPED_FOLDERS:
        name = f"{__name__}.{folder}"
        if name in sys.modules:
            continue
        init = _SOURCE_ROOT / folder / "__init__.py"
        spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(init.parent)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        globals()[folder] = module  # what the import system does for a submodule it found itself


# Installed (editable or not), the import system already knows the mapping: the three folders
# then resolve through it, never through this function.
if (_SOURCE_ROOT / "pyproject.toml").is_file() and (_SOURCE_ROOT / "weight_sync" / "engine_loader.py").is_file() \
        and importlib.util.find_spec(f"{__name__}.weight_sync") is None:
    _register_source_folders()
