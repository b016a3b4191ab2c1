"""Steps whose loss or gradient norm is not finite: said at once, counted, and a run of them stops
the run. The trainer already skips such an update (actors/trainer.py `train_step`) so the weights
stay as they were; without this a run at kl_coef inf would log `loss: null` for every step and end
"finished" having learned nothing."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from rlsys.errors import RunFailed

logger = logging.getLogger(__name__)


class NonfiniteSteps(RunFailed):
    """Too many steps in a row had a non-finite loss or gradient norm."""


@dataclass
class NonfiniteGuard:
    limit: int  # trainer.max_nonfinite_steps
    in_a_row: int = 0
    _shown: str = ""

    def check(self, step: int, row: dict) -> None:
        """Reads the step's train metrics from `row`, says when they are not finite, and adds
        `nonfinite_steps_in_a_row` to it (`stop_if_exceeded` after the row is recorded)."""
        values = {key: row[key] for key in ("loss", "grad_norm") if isinstance(row.get(key), float)}
        if not values:  # no optimizer step was due (nothing to train on): neither good nor bad
            row["nonfinite_steps_in_a_row"] = self.in_a_row
            return
        bad = {key: value for key, value in values.items() if not math.isfinite(value)}
        self.in_a_row = self.in_a_row + 1 if bad or row.get("nonfinite_grad_steps") else 0
        row["nonfinite_steps_in_a_row"] = self.in_a_row
        if self.in_a_row:
            self._shown = ", ".join(f"{key} {value}" for key, value in bad.items()) or "a gradient norm not finite"
            logger.warning("step %d: %s: its optimizer update was skipped, the weights are unchanged "
                           "(%d in a row; the run stops at %d, trainer.max_nonfinite_steps)",
                           step, self._shown, self.in_a_row, self.limit)

    def stop_if_exceeded(self, step: int) -> None:
        if self.in_a_row >= self.limit:
            raise NonfiniteSteps(
                f"step {step}: {self._shown}; {self.in_a_row} steps in a row had a loss or gradient norm that is "
                "not finite (trainer.max_nonfinite_steps): nothing was learned in them. Usual causes: a coefficient "
                "or learning rate too large (algorithm.kl_coef, entropy_coef, trainer.lr), rewards far larger than "
                "the others (see reward_std), a model dtype that overflows (model.dtype)")
