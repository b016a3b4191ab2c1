"""rlsys: GRPO post-training on Ray, FSDP2 and SGLang.

`rlsys.actors`, `rlsys.rollout` and `rlsys.weight_sync` live in the repository's top-level folders
of those names; pyproject.toml maps them under this package when it is installed. A source tree
that is imported without being installed (e.g. uploaded as a Ray job's working_dir) finds them
through this package's path, so both ways import the same files.
"""

from pathlib import Path

_SOURCE_ROOT = Path(__file__).resolve().parent.parent
if (_SOURCE_ROOT / "pyproject.toml").is_file() and (_SOURCE_ROOT / "weight_sync" / "engine_loader.py").is_file():
    __path__.append(str(_SOURCE_ROOT))  # noqa: F821 - a package's __path__ is defined by the import system
