"""A rollout mode written the way a new one is added (rlsys/config/rollout_modes.py says how): its
config variant and its runner, here in one file that the process running `rlsys train` imports
first (tests/e2e/test_rollout_modes.py). `reuse`: each generated batch trains `reuse` steps in a
row, the later ones off-policy (the engines then hold newer weights than sampled it), so TIS is on
by default as for the built-in off-policy modes."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlsys.config import RolloutMode, register_rollout_mode
from rlsys.records import SamplingParams
from rlsys.run.batches import StepBatch, StepBatches
from rlsys.run.rollout_modes import ModeRunner, runs_mode
from rlsys.run.run_state import Run


@register_rollout_mode
class ReuseMode(RolloutMode):
    type: Literal["reuse"] = Field("reuse", description="The mode.")
    reuse: int = Field(2, ge=1, description="Steps each generated batch trains.")
    summary = "Each generated batch trains `reuse` steps in a row"
    off_policy = True
    takes_images = False
    why_not = "a test's mode"


class ReusedBatches(StepBatches):
    def __init__(self, run: Run, sampling: SamplingParams, reuse: int):
        super().__init__(run, sampling)
        self.reuse, self.last = reuse, None

    def take(self, step: int, trainer_version: int) -> StepBatch:
        if self.last is None or step % self.reuse == 0:
            self.last = super().take(step, trainer_version)
            self.last.metrics["batch_reused"] = 0
        else:
            self.last.metrics["batch_reused"] = 1
        return self.last


@runs_mode(ReuseMode)
class ReuseRunner(ModeRunner):
    mode: ReuseMode

    def step_batches(self, run: Run, sampling: SamplingParams) -> StepBatches:
        return ReusedBatches(run, sampling, self.mode.reuse)
