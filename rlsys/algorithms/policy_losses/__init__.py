"""Policy losses (algorithm.policy_loss), one module each in this folder: a `PolicyLoss` subclass
(base.py) that holds the loss's own parameters, its default aggregation and its computation, and
registers itself by name with `@register_policy_loss`.

Adding a loss is one file here: every module of this folder is imported below, so the config, the
trainer, its metrics and docs/configuration.md pick it up with no other edit.
"""

from __future__ import annotations

import importlib
import pkgutil

from rlsys.algorithms.policy_losses.base import (
    POLICY_LOSSES,
    PolicyLoss,
    fold_flat_loss_keys,
    policy_loss_named,
    register_policy_loss,
)

__all__ = ["POLICY_LOSSES", "PolicyLoss", "fold_flat_loss_keys", "policy_loss_named", "register_policy_loss"]

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
