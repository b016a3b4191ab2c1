"""A run as the loop sees it: `Run`, everything `train_loop` works with (started and restored by
rlsys/run/lifecycle.py), and `Rounds`, how it generates one round of a step's groups (made by the
run's rollout mode, rlsys/run/rollout_modes/). Its own module so that the loop and the
batch sources both import it and neither imports the other back."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from rlsys.config import RunConfig
from rlsys.data.datasets import PromptSampler
from rlsys.observability.metrics import MetricsLog
from rlsys.observability.rollouts import RolloutDump
from rlsys.observability.samples import SHOWN_IN_STATUS, SamplesLog
from rlsys.observability.status.state import RunStatus
from rlsys.observability.tracking import Trackers
from rlsys.records import EncodedPrompt, Generation, SamplingParams
from rlsys.rewards.pool import RewardPool
from rlsys.rewards.remote import RemoteReward
from rlsys.rollout.manager import RolloutManager
from rlsys.run.assets import RunAssets
from rlsys.run.checkpointing import Checkpointer, CheckpointStore, CoordinatorState
from rlsys.run.components import Components, restore
from rlsys.run.evaluation import Evaluator
from rlsys.run.nonfinite import NonfiniteGuard
from rlsys.run.profiling import StepProfiler
from rlsys.run.reporting import HealthMonitor, ProgressLines, shows_progress_bar
from rlsys.run.reward_errors import RewardErrorLog

logger = logging.getLogger(__name__)


class Rounds(Protocol):
    """How one round of a step's groups is generated, and what a checkpoint keeps of it."""

    def begin_step(self, trainer_version: int) -> None: ...

    def round(self, rollout: RolloutManager, sampler: PromptSampler, sampling: SamplingParams, wanted: int,
              recover: bool) -> tuple[list[EncodedPrompt], list[Generation]]:
        """At least `wanted` groups' prompts and their generations, grouped prompt by prompt."""

    def step_metrics(self, trained: list[Generation], trainer_version: int) -> dict: ...

    def saved(self) -> list[dict] | None:
        """What a checkpoint keeps (coordinator.json's partial_groups)."""

    def restore(self, saved: list[dict] | None) -> None: ...



@dataclass
class Run:
    """Everything the loop works with, started and restored by `run` (rlsys/run/lifecycle.py)."""

    config: RunConfig
    assets: RunAssets
    parts: Components
    state: CoordinatorState
    status: RunStatus
    log: MetricsLog
    sampler: PromptSampler
    evaluator: Evaluator
    checkpointer: Checkpointer
    health: HealthMonitor
    rewards: RewardPool | RemoteReward
    trackers: Trackers
    rounds: Rounds  # how a round of groups is generated: on-policy, or partial rollouts carried between steps
    trainer_restarts: int = 0  # automatic resumes after a trainer rank died
    # The version of the weights the trainer holds: the engines' (state.weight_version) except between
    # a train step and its sync, when it is one ahead. An engine restarted then gets these weights,
    # so it must be told this version (the sync it died in expects it).
    trainer_version: int = 0
    nonfinite: NonfiniteGuard | None = None  # set from trainer.max_nonfinite_steps
    progress: ProgressLines | None = None  # set from logging
    profiler: StepProfiler | None = None  # set from profile
    reward_error_log: RewardErrorLog | None = None  # set from run_dir
    samples: SamplesLog | None = None  # RUN_DIR/samples.jsonl, set from run_dir
    rollouts: RolloutDump | None = None  # RUN_DIR/rollouts/ with logging.save_rollouts

    def __post_init__(self):
        if self.profiler is None:
            self.profiler = StepProfiler(self.config.profile.steps, Path(self.config.run_dir), lambda: self.parts.trainer)
        if self.reward_error_log is None:
            self.reward_error_log = RewardErrorLog(Path(self.config.run_dir))
        if self.samples is None:
            self.samples = SamplesLog(Path(self.config.run_dir) / "samples.jsonl")
        if self.rollouts is None:
            self.rollouts = RolloutDump(Path(self.config.run_dir), self.config.logging.save_rollouts)
        if self.nonfinite is None:
            self.nonfinite = NonfiniteGuard(self.config.trainer.max_nonfinite_steps)
        if self.progress is None:
            logging_config = self.config.logging
            self.progress = ProgressLines(self.config.trainer.total_steps, shows_progress_bar(logging_config.progress_bar),
                                          logging_config.summary_interval_s)

    @contextmanager
    def phase(self, row: dict, state: str, timing: str):
        """Shows `state` in the status and adds the block's seconds to row["time_<timing>_s"]."""
        self.status.set_state(state)
        start = time.perf_counter()
        try:
            with self.profiler.span(row["step"], timing):
                yield
        finally:
            row[f"time_{timing}_s"] = row.get(f"time_{timing}_s", 0.0) + time.perf_counter() - start

    def continue_from(self, checkpoint: Path | None) -> None:
        """Trainer, engines, data position and metrics as `checkpoint` left them (fresh if None)."""
        self.state = restore(self.config, self.parts, checkpoint)
        self.log.truncate_from(self.state.next_step)  # rows of steps that will run again
        self.samples.truncate_from(self.state.next_step)
        self.trackers.rewind(self.state.next_step)
        if checkpoint is not None:
            log_the_step_it_closes(checkpoint, self.state.next_step, self.log, self.samples, self.trackers)
        self.status.record_samples(self.samples.latest(SHOWN_IN_STATUS))
        self.status.replace_steps(self.log.rows)
        self.sampler.restore(self.state.data_epoch, self.state.data_index)
        self.trainer_version = self.state.weight_version
        self.rounds.restore(self.state.partial_groups)
        self.health.refresh(self.status)
        self.parts.handoff.to_engines()  # a sleeping trainer leaves the device to the engines

    def steps(self) -> Iterator[int]:
        """The steps still to run, with a progress bar; waits while paused, ends on a stop request."""
        from tqdm import tqdm

        total = self.config.trainer.total_steps
        bar = tqdm(range(self.state.next_step, total), initial=self.state.next_step, total=total, desc="GRPO",
                   disable=not shows_progress_bar(self.config.logging.progress_bar), dynamic_ncols=True)
        last_eval = None
        for step in bar:
            _wait_while_paused(self.status)
            if self.status.stop_requested:
                return
            yield step
            row = self.log.rows[-1]
            last_eval = row.get("eval_reward_mean", last_eval)
            reward = row.get("reward_mean")  # None: no sample of the step was scored
            bar.set_postfix(reward="-" if reward is None else f"{reward:.2f}",
                            eval="-" if last_eval is None else f"{last_eval:.2f}")



def _wait_while_paused(status: RunStatus) -> None:
    if status.pause_requested and not status.stop_requested:
        status.set_state("paused")
        status.save_snapshot()
        while status.pause_requested and not status.stop_requested:
            time.sleep(0.2)


def log_the_step_it_closes(checkpoint: Path, next_step: int, log: MetricsLog, samples: SamplesLog,
                           trackers: Trackers) -> None:
    """The row and samples of the step `checkpoint` closes (step `next_step - 1`), logged from the
    checkpoint where the logs lack them: the run stopped (a kill, a rank's death) after the checkpoint,
    before their append. That step is not run again, so nothing else would bring its record back."""
    record = CheckpointStore.load_step_record(checkpoint)
    if record is None or record.row.get("step") != next_step - 1:
        return
    step = record.row["step"]
    if not any(row.get("step") == step for row in log.rows):
        logger.warning("step %d's metrics were not in metrics.jsonl (the run stopped between its checkpoint "
                       "and their append); logged from %s, without the step's checkpoint and total times",
                       step, checkpoint.name)
        log.append(record.row)
        trackers.log(record.row)
    if record.samples and not samples.holds_step(step):
        samples.append(record.samples)
        trackers.log_samples(step, record.samples)
