"""The runners of the rollout modes (rollout.mode, rlsys/config/rollout_modes.py), one module each
in this folder, registered with `@runs_mode(TheModesConfig)`. Every module of this folder is
imported below, so the loop finds a new mode's runner with no other edit."""

from __future__ import annotations

import importlib
import pkgutil

from rlsys.run.rollout_modes.base import MODE_RUNNERS, ModeRunner, runner_for, runs_mode

__all__ = ["MODE_RUNNERS", "ModeRunner", "runner_for", "runs_mode"]

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
