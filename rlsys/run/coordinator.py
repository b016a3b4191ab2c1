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

from rlsys.algorithms.samples import ScoredBatch, prepare, truncated_fraction
from rlsys.config import RunConfig
from rlsys.observability.samples import shown_samples
from rlsys.run.checkpointing import StepRecord
from rlsys.run.components import sync_engines
from rlsys.run.generation import sampling_params, trajectory_metrics
from rlsys.run.rollout_modes import runner_for
from rlsys.run.run_state import Run

logger = logging.getLogger(__name__)


def train_loop(run: Run) -> None:
    config, parts, state = run.config, run.parts, run.state
    sampling = sampling_params(config, run.assets, config.rollout.temperature, config.rollout.top_p)
    batches = runner_for(config.rollout.mode).step_batches(run, sampling)  # at each step's start, or ahead
    try:
        for step in run.steps():
            row: dict = {"step": step}
            run.profiler.step_starting(step)
            step_start = time.perf_counter()
            with run.phase(row, "rollout", "generate"):  # generated now, or waited for when made ahead
                batch = batches.take(step, state.weight_version)
            row.update(batch.metrics, data_epoch=batch.start[0], data_index=batch.start[1])
            row.update(batch.scored.reward_metrics())  # task rewards, before any penalty
            shown = _shown_samples(config, step, batch.scored)
            if run.evaluator.due(step):  # the engines hold this step's weights (batches ahead may generate beside it)
                with run.phase(row, "evaluating", "eval"):
                    row.update(run.evaluator.evaluate(step))
                shown += run.evaluator.samples
            last_step = step + 1 == config.trainer.total_steps or _reached_eval_target(config, row, step)
            batches.before_training(step, step_start)  # batches ahead: the next steps' generate while this one trains

            if parts.handoff.enabled:
                with run.phase(row, "training", "offload"):
                    row.update(parts.handoff.to_trainer(step))  # engines release their memory, the trainer wakes
            with run.phase(row, "training", "train"):
                run.trainer_version = state.weight_version + 1  # what the sync below pushes, trained or skipped
                row.update(_train(run, step, batch.scored))
                run.nonfinite.check(step, row)
            with run.phase(row, "syncing", "sync"), parts.rollout.weights_updating():
                row.update(sync_engines(config, parts, state.weight_version + 1))
            row.update(batches.metrics(batch, state.weight_version))
            state.finish_step(step, *batch.end)  # an in-flight next batch is generated again after a resume
            row.update(_rollout_metrics(batch.generations), synced_weight_version=state.weight_version,
                       engine_restarts=parts.rollout.fleet.restarts, trainer_restarts=run.trainer_restarts)
            if run.checkpointer.due(state.next_step, run.status.take_checkpoint_request(), run.status.stop_requested,
                                    last_step):
                with run.phase(row, "checkpointing", "checkpoint"):
                    # the step's row goes into its checkpoint: a kill before the row's append below must
                    # not leave a resumable run that lost the record of a step it will not run again
                    run.checkpointer.save(state, StepRecord({**row, "timestamp": time.time()}, shown))
            if parts.handoff.enabled:
                with run.phase(row, "training", "offload"):
                    row.update(parts.handoff.to_engines(step))  # the trainer sleeps, the engines take theirs back

            row["time_step_s"] = time.perf_counter() - step_start
            logger.debug("step %d: %s; the whole step %.2f s", step, _phase_seconds(row), row["time_step_s"])
            row["timestamp"] = time.time()  # wall clock when the step ended (unix seconds)
            row["tokens_per_s"] = _tokens(batch.generations) / row["time_step_s"]
            _record(run, row, shown, last_step=last_step)
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
        run.parts.handoff.to_trainer()  # a sleeping trainer's storages are empty
    run.checkpointer.save(run.state)


def _reached_eval_target(config: RunConfig, row: dict, step: int) -> bool:
    """eval.stop_at_reward: whether this step's eval reached it (the run then ends with this step)."""
    target, reward = config.eval.stop_at_reward, row.get("eval_reward_mean")
    if target is None or reward is None or reward < target:
        return False
    logger.info("eval reward %.3f at step %d reached eval.stop_at_reward %g: this is the last step",
                reward, step, target)
    return True


def _train(run: Run, step: int, scored: ScoredBatch) -> dict:
    """The step's training sequences (rlsys/algorithms/samples.py `prepare`: KL in reward,
    advantages), saved when logging.save_rollouts, then the trainer's step; its metrics. A step
    left with no token to train on makes no optimizer step."""
    config, parts = run.config, run.parts
    kl = parts.trainer.compute_sequence_kl if config.algorithm.kl_in_reward else None
    sequences, metrics = prepare(scored.samples, config.algorithm, config.rollout.n_samples_per_prompt, kl)
    if not sequences:
        logger.warning("no token to train on this step; its optimizer step is skipped")
        return {"train_tokens": 0.0, "skipped_train_steps": 1}
    run.rollouts.save(step, scored.samples, sequences)
    return {**metrics, **parts.trainer.train_step(sequences)}


def _tokens(generations: list) -> int:
    return sum(len(g.prompt_ids) + len(g.response_ids) for g in generations)


def _rollout_metrics(generations: list) -> dict:
    return {
        "response_len_mean": sum(len(g.response_ids) for g in generations) / max(len(generations), 1),
        "truncated_fraction": truncated_fraction(generations),
        "weight_version": min((g.weight_version for g in generations), default=None),  # what sampled them
        **trajectory_metrics(generations),
    }


def _shown_samples(config: RunConfig, step: int, scored: ScoredBatch) -> list[dict]:
    """The step's answers to show: the first of each of its first logging.samples_per_step groups."""
    samples = scored.samples
    return shown_samples(step, "train", [s.record.prompt for s in samples], [s.response_text for s in samples],
                         [s.reward for s in samples], [s.generation.finish_reason for s in samples],
                         [len(s.generation.response_ids) for s in samples], config.rollout.n_samples_per_prompt,
                         config.logging.samples_per_step, [s.record.images for s in samples])


def _record(run: Run, row: dict, shown: list[dict], last_step: bool) -> None:
    run.log.append(row)
    run.samples.append(shown)
    run.status.record_samples(shown)
    run.trackers.log(row)
    run.trackers.log_samples(row["step"], shown)
    run.status.record_step(row)
    run.progress.step(row, last_step)
    if run.health.due(last_step):
        run.health.refresh(run.status)
    run.status.save_snapshot()
