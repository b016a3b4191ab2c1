"""What a rollout mode's runner is (`ModeRunner`) and the registry of runners by the config variant
they run (rlsys/config/rollout_modes.py). A runner makes two choices for the run: its `Rounds`
(how one round of a step's groups is generated, and what a checkpoint keeps of it) and its
`StepBatches` (when a step's batch is generated). The defaults are on-policy rounds at each
step's start, which a mode overrides where it differs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlsys.config import RolloutMode, RunConfig
from rlsys.records import SamplingParams
from rlsys.run.batches import OnPolicyRounds, StepBatches
from rlsys.run.generation import SampleMaker

if TYPE_CHECKING:
    from rlsys.run.run_state import Rounds, Run


class ModeRunner:
    """How a rollout mode makes the run's batches (`self.mode`: its config section)."""

    def __init__(self, mode: RolloutMode):
        self.mode = mode

    def rounds(self, config: RunConfig, maker: SampleMaker) -> Rounds:
        """How one round of a step's groups is generated (made once, at the run's start)."""
        return OnPolicyRounds(maker, config.rollout.n_samples_per_prompt)

    def step_batches(self, run: Run, sampling: SamplingParams) -> StepBatches:
        """When each step's batch is generated: what the loop calls once per step."""
        return StepBatches(run, sampling)


MODE_RUNNERS: dict[type[RolloutMode], type[ModeRunner]] = {}


def runs_mode(mode: type[RolloutMode]):
    """Class decorator: the runner of the config variant `mode` (one runner a mode)."""
    def register(cls: type[ModeRunner]) -> type[ModeRunner]:
        if mode in MODE_RUNNERS and MODE_RUNNERS[mode] is not cls:
            raise ValueError(f"rollout mode {mode.__name__} has two runners ({MODE_RUNNERS[mode].__name__}, "
                             f"{cls.__name__})")
        MODE_RUNNERS[mode] = cls
        return cls
    return register


def runner_for(mode: RolloutMode) -> ModeRunner:
    """The runner of a run's rollout.mode."""
    runner = MODE_RUNNERS.get(type(mode))
    if runner is None:
        raise TypeError(f"rollout mode {mode.type!r} ({type(mode).__name__}) has no runner: add one to "
                        "rlsys/run/rollout_modes/ with @runs_mode")
    return runner(mode)
