"""The loop: `train_loop` drives the GRPO steps of a `Run`.

One step: the step's batch (rlsys/run/batches.py: engines generate n samples per prompt, rewards)
-> (eval when due) -> trainer wakes, group advantages, old/ref log-probs and optimizer steps ->
weight sync into the engines -> (checkpoint when due) -> trainer sleeps (colocated). `train_loop`
is the table of contents: every line is a call into a component. The run's life (start, restore,
signals, failures, the run directory) is rlsys/run/lifecycle.py; its components'
(start, sync, stop) rlsys/run/components.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rlsys.algorithms.samples import ScoredBatch, prepare, truncated_fraction
from rlsys.config import RunConfig
from rlsys.data.datasets import PromptSampler
from rlsys.observability.metrics import MetricsLog
from rlsys.observability.status.state import RunStatus
from rlsys.observability.tracking import Trackers
from rlsys.rewards.pool import RewardPool
from rlsys.rewards.remote import RemoteReward
from rlsys.run.assets import RunAssets
from rlsys.run.batches import Rounds, step_batches
from rlsys.run.checkpointing import Checkpointer, CoordinatorState
from rlsys.run.components import Components, restore, sync_engines
from rlsys.run.evaluation import Evaluator, sampling_params
from rlsys.run.generation import trajectory_metrics
from rlsys.run.nonfinite import NonfiniteGuard
from rlsys.run.profiling import StepProfiler
from rlsys.run.reporting import HealthMonitor, ProgressLines, shows_progress_bar

logger = logging.getLogger(__name__)

__all__ = ["Run", "train_loop"]


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

    def __post_init__(self):
        if self.profiler is None:
            self.profiler = StepProfiler(self.config.profile.steps, Path(self.config.run_dir), lambda: self.parts.trainer)
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
        self.status.replace_steps(self.log.rows)
        self.sampler.restore(self.state.data_epoch, self.state.data_index)
        self.trainer_version = self.state.weight_version
        self.rounds.restore(self.state.partial_groups)
        self.health.refresh(self.status)
        self.parts.handoff.to_engines({})  # a sleeping trainer leaves the device to the engines

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


def train_loop(run: Run) -> None:
    config, parts, state = run.config, run.parts, run.state
    sampling = sampling_params(config, run.assets, config.rollout.temperature, config.rollout.top_p)
    batches = step_batches(run, sampling)  # at each step's start, or ahead of the trainer (rollout.max_staleness)
    try:
        for step in run.steps():
            row: dict = {"step": step}
            run.profiler.step_starting(step)
            step_start = time.perf_counter()
            batch = batches.take(row, step, state.weight_version)
            row.update(batch.metrics, data_epoch=batch.start[0], data_index=batch.start[1])
            row.update(batch.scored.reward_metrics())  # task rewards, before any penalty
            if run.evaluator.due(step):  # the engines hold this step's weights (batches ahead may generate beside it)
                with run.phase(row, "evaluating", "eval"):
                    row.update(run.evaluator.evaluate(step))
            last_step = step + 1 == config.trainer.total_steps or _reached_eval_target(config, row, step)
            batches.before_training(step, step_start)  # batches ahead: the next steps' generate while this one trains

            if parts.handoff.enabled:
                with run.phase(row, "training", "offload"):
                    parts.handoff.to_trainer(row)  # engines release their memory, the trainer wakes
            with run.phase(row, "training", "train"):
                run.trainer_version = state.weight_version + 1  # what the sync below pushes, trained or skipped
                row.update(_train(config, parts, batch.scored))
                run.nonfinite.check(step, row)
            with run.phase(row, "syncing", "sync"), parts.rollout.weights_updating():
                row.update(sync_engines(config, parts, state.weight_version + 1))
            row.update(batches.metrics(batch, state.weight_version))
            state.finish_step(step, *batch.end)  # an in-flight next batch is generated again after a resume
            if run.checkpointer.due(state.next_step, run.status.take_checkpoint_request(), run.status.stop_requested,
                                    last_step):
                with run.phase(row, "checkpointing", "checkpoint"):
                    run.checkpointer.save(state)
            if parts.handoff.enabled:
                with run.phase(row, "training", "offload"):
                    parts.handoff.to_engines(row)  # the trainer sleeps, the engines take their memory back

            row["time_step_s"] = time.perf_counter() - step_start
            logger.debug("step %d: %s; the whole step %.2f s", step, _phase_seconds(row), row["time_step_s"])
            row["timestamp"] = time.time()  # wall clock when the step ended (unix seconds)
            row.update(_rollout_metrics(batch.generations, row["time_step_s"]), synced_weight_version=state.weight_version,
                       engine_restarts=parts.rollout.restarts, trainer_restarts=run.trainer_restarts)
            _record(run, row, last_step=last_step)
            run.profiler.step_ended(step, last_step)
            run.nonfinite.stop_if_exceeded(step)
            if last_step:
                break
    finally:
        batches.close()  # batches still ahead are dropped: their prompts are drawn again after a resume
        run.profiler.finish()  # a run that ended before the last profiled step keeps what it recorded
    if run.status.stop_requested:
        _checkpoint_before_stopping(run)


def _phase_seconds(row: dict) -> str:
    """The step's phases from its time_<phase>_s metrics, e.g. "generate 0.08 s, train 0.06 s, sync 0.03 s"."""
    return ", ".join(f"{key[5:-2]} {value:.2f} s" for key, value in row.items()
                     if key.startswith("time_") and key.endswith("_s") and key != "time_step_s")


def _checkpoint_before_stopping(run: Run) -> None:
    """A stop that came after the last step's checkpoint decision still leaves that step saved."""
    if run.state.next_step == 0 or run.checkpointer.store.has(run.state.next_step):
        return
    run.status.set_state("checkpointing")
    if run.parts.trainer.asleep:
        run.parts.handoff.to_trainer({})  # a sleeping trainer's storages are empty
    run.checkpointer.save(run.state)


def _reached_eval_target(config: RunConfig, row: dict, step: int) -> bool:
    """eval.stop_at_reward: whether this step's eval reached it (the run then ends with this step)."""
    target, reward = config.eval.stop_at_reward, row.get("eval_reward_mean")
    if target is None or reward is None or reward < target:
        return False
    logger.info("eval reward %.3f at step %d reached eval.stop_at_reward %g: this is the last step",
                reward, step, target)
    return True


def _train(config: RunConfig, parts: Components, scored: ScoredBatch) -> dict:
    """The step's training sequences (rlsys/algorithms/samples.py `prepare`: KL in reward,
    advantages), then the trainer's step; its metrics. A step left with no token to train on makes
    no optimizer step."""
    kl = parts.trainer.compute_sequence_kl if config.algorithm.kl_in_reward else None
    sequences, metrics = prepare(scored.samples, config.algorithm, config.rollout.n_samples_per_prompt, kl)
    if not sequences:
        logger.warning("no token to train on this step; its optimizer step is skipped")
        return {"train_tokens": 0.0, "skipped_train_steps": 1}
    return {**metrics, **parts.trainer.train_step(sequences)}


def _rollout_metrics(generations: list, step_seconds: float) -> dict:
    tokens = sum(len(g.prompt_ids) + len(g.response_ids) for g in generations)
    return {
        "response_len_mean": sum(len(g.response_ids) for g in generations) / max(len(generations), 1),
        "truncated_fraction": truncated_fraction(generations),
        "weight_version": min((g.weight_version for g in generations), default=None),  # what sampled them
        "tokens_per_s": tokens / step_seconds,
        **trajectory_metrics(generations),
    }


def _record(run: Run, row: dict, last_step: bool) -> None:
    run.log.append(row)
    run.trackers.log(row)
    run.status.record_step(row)
    run.progress.step(row, last_step)
    if run.health.due(last_step):
        run.health.refresh(run.status)
    run.status.save_snapshot()


def _wait_while_paused(status: RunStatus) -> None:
    if status.pause_requested and not status.stop_requested:
        status.set_state("paused")
        status.save_snapshot()
        while status.pause_requested and not status.stop_requested:
            time.sleep(0.2)
