"""A step whose loss or gradient norm is not finite is said and counted, and a run of them stops the run."""

import logging
import math

import pytest

from rlsys.run.nonfinite import NonfiniteGuard, NonfiniteSteps


def test_nonfinite_steps_are_said_counted_and_stop_the_run_at_the_limit(caplog):
    guard = NonfiniteGuard(limit=2)
    rows = [{"loss": 0.5, "grad_norm": 1.0, "nonfinite_grad_steps": 0.0},
            {"loss": math.inf, "grad_norm": math.nan, "nonfinite_grad_steps": 1.0},
            {"loss": 0.4, "grad_norm": 2.0, "nonfinite_grad_steps": 0.0},  # a good step resets the count
            {"loss": 0.3, "grad_norm": math.inf, "nonfinite_grad_steps": 1.0}]
    with caplog.at_level(logging.WARNING, logger="rlsys.run.nonfinite"):
        for step, row in enumerate(rows):
            guard.check(step, row)
            guard.stop_if_exceeded(step)
    assert [row["nonfinite_steps_in_a_row"] for row in rows] == [0, 1, 0, 1]
    assert [record.getMessage().split(":")[0] for record in caplog.records] == ["step 1", "step 3"]
    assert "loss inf, grad_norm nan" in caplog.records[0].getMessage()
    last = {"loss": math.nan, "grad_norm": math.nan, "nonfinite_grad_steps": 1.0}
    guard.check(4, last)
    with pytest.raises(NonfiniteSteps, match=r"step 4: loss nan, grad_norm nan; 2 steps in a row had a loss.*kl_coef"):
        guard.stop_if_exceeded(4)


def test_a_step_with_nothing_to_train_neither_counts_nor_resets():
    guard = NonfiniteGuard(limit=3)
    guard.check(0, {"loss": math.nan, "grad_norm": math.nan, "nonfinite_grad_steps": 1.0})
    guard.check(1, {"train_tokens": 0.0, "skipped_train_steps": 1})
    assert guard.in_a_row == 1
