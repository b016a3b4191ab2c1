"""Rollout corrections (algorithm.corrections): what corrects the policy loss for the engine having
sampled from a slightly different distribution than the trainer computes (bf16 kernels, another
attention, MoE routing, stale weights). One module each in this folder: a `Correction` subclass
(base.py) that holds its parameters and its per-token factor, registered by name with
`@register_correction`.

Adding one is one file here: every module of this folder is imported below, so the config, the
trainer, its metrics and docs/configuration.md pick it up with no other edit.
"""

from __future__ import annotations

import importlib
import pkgutil

from rlsys.algorithms.corrections.base import (
    CORRECTIONS,
    Correction,
    CorrectionInputs,
    CorrectionTerms,
    correction_named,
    register_correction,
)

__all__ = ["CORRECTIONS", "Correction", "CorrectionInputs", "CorrectionTerms", "correction_named",
           "register_correction"]

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
