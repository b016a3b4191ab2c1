"""The run: `run(config)` starts everything and `train_loop` drives the GRPO steps.

One step: (eval when due) -> engines generate n samples per prompt -> rewards -> trainer wakes,
group advantages, old/ref log-probs and optimizer steps -> weight sync into the engines ->
(checkpoint when due) -> trainer sleeps (colocated). `train_loop` is the table of contents: every
line is a call into a component; start-up, restore and shutdown live in rlsys/run/lifecycle.py.
"""

from __future__ import annotations

import itertools
import logging
import random
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from ray.exceptions import RayError

from rlsys.actors.group import TrainerHang
from rlsys.algorithms.samples import ScoredBatch, check_reward_errors, prepare, score_groups, truncated_fraction
from rlsys.algorithms.shaping import drop_stale_groups, drop_uniform_groups
from rlsys.config import RunConfig, dump_config
from rlsys.data.datasets import PromptSampler, repeated_prompts_note
from rlsys.errors import RunFailed
from rlsys.observability.metrics import MetricsLog
from rlsys.observability.status.state import RunStatus
from rlsys.observability.tracking import Trackers, check_backends_installed
from rlsys.rewards.pool import RewardPool, make_reward_scorer
from rlsys.rewards.remote import RemoteReward
from rlsys.rollout.manager import EngineCallFailed, EngineRestartLimit, is_engine_death
from rlsys.run.assets import RunAssets, load_assets, refuse_incompatible_checkpoint
from rlsys.run.checkpointing import Checkpointer, CheckpointStore, CoordinatorState, checkpoint_to_resume, disk_full_failure
from rlsys.run.evaluation import Evaluator, sampling_params
from rlsys.run.generation import SampleMaker, trajectory_metrics
from rlsys.run.hangs import HangReporter
from rlsys.run.lifecycle import (
    Components,
    bring_engines_up_to_date,
    restart_trainers,
    restore,
    run_uses_gpus,
    start_components,
    sync_engines,
)
from rlsys.run.nonfinite import NonfiniteGuard
from rlsys.run.partial_rollouts import PartialRollouts
from rlsys.run.profiling import StepProfiler
from rlsys.run.reporting import HealthMonitor, ProgressLines, new_status, status_server
from rlsys.run.standing_engines import cluster_address
from rlsys.system.cluster import ray_cluster
from rlsys.system.model_source import resolve_model_paths
from rlsys.system.reaper import start_reaper
from rlsys.system.run_lock import RunDirLock
from rlsys.system.shm_sweep import sweep_shared_memory
from rlsys.system.topology import Topology

logger = logging.getLogger(__name__)

__all__ = ["RunFailed", "run"]


@dataclass
class Run:
    """Everything the loop works with, started and restored by `run`."""

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
    maker: SampleMaker
    partials: PartialRollouts | None = None  # rollout.partial_rollouts: the groups carried between steps
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
            self.progress = ProgressLines(self.config.trainer.total_steps, logging_config.progress_bar,
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
        self._restore_partial_groups()
        self.health.refresh(self.status)
        self.parts.handoff.to_engines({})  # a sleeping trainer leaves the device to the engines

    def _restore_partial_groups(self) -> None:
        if self.partials is not None:
            self.partials.restore(self.state.partial_groups)
        elif self.state.partial_groups:
            logger.warning("the checkpoint carries %d partial-rollout group(s) in flight; without "
                           "rollout.partial_rollouts their prompts are not trained", len(self.state.partial_groups))

    def steps(self) -> Iterator[int]:
        """The steps still to run, with a progress bar; waits while paused, ends on a stop request."""
        from tqdm import tqdm

        total = self.config.trainer.total_steps
        bar = tqdm(range(self.state.next_step, total), initial=self.state.next_step, total=total, desc="GRPO",
                   disable=not self.config.logging.progress_bar, dynamic_ncols=True)
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
    ahead = BatchesAhead(run, sampling, config.rollout.max_staleness) if config.rollout.max_staleness else None
    try:
        for step in run.steps():
            row: dict = {"step": step}
            run.profiler.step_starting(step)
            step_start = time.perf_counter()
            batch = ahead.take(row, state.weight_version) if ahead else None
            if batch is None:
                with run.phase(row, "rollout", "generate"):
                    batch = collect_step_batch(run, sampling, step)
            row.update(batch.metrics, data_epoch=batch.start[0], data_index=batch.start[1])
            row.update(batch.scored.reward_metrics())  # task rewards, before any penalty
            if run.evaluator.due(step):  # the engines hold this step's weights (batches ahead may generate beside it)
                with run.phase(row, "evaluating", "eval"):
                    row.update(run.evaluator.evaluate(step))
            last_step = step + 1 == config.trainer.total_steps or _reached_eval_target(config, row, step)
            if ahead:
                ahead.start(step + 1, step_start)  # the next steps' batches generate while this step trains

            if parts.handoff.enabled:
                with run.phase(row, "training", "offload"):
                    parts.handoff.to_trainer(row)  # engines release their memory, the trainer wakes
            with run.phase(row, "training", "train"):
                run.trainer_version = state.weight_version + 1  # what the sync below pushes, trained or skipped
                row.update(_train(config, parts, batch.scored))
                run.nonfinite.check(step, row)
            with run.phase(row, "syncing", "sync"), parts.rollout.weights_updating():
                row.update(sync_engines(config, parts, state.weight_version + 1))
            if ahead:
                row.update(_staleness(batch.generations, state.weight_version, config.rollout.max_staleness))
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
        if ahead:
            ahead.close()
        run.profiler.finish()  # a run that ended before the last profiled step keeps what it recorded
    if run.status.stop_requested:
        _checkpoint_before_stopping(run)


@dataclass
class StepBatch:
    """One step's scored groups, every generation made for it, and where the data stood."""

    scored: ScoredBatch
    generations: list
    metrics: dict
    start: tuple[int, int]  # (data epoch, index) before its prompts were drawn
    end: tuple[int, int]  # and after


def collect_step_batch(run: Run, sampling, step: int, recover: bool = True) -> StepBatch:
    """Prompts -> engine samples -> rewards, one round of data.prompts_per_step prompts. With
    algorithm.dynamic_sampling, groups whose scores are all equal are dropped and more rounds run
    until the step has prompts_per_step groups (surplus groups are dropped too) or
    algorithm.max_sampling_rounds is reached."""
    config, algorithm = run.config, run.config.algorithm
    group_size, wanted = config.rollout.n_samples_per_prompt, config.data.prompts_per_step
    batch, generations, metrics = ScoredBatch(samples=[], sampling_rounds=0), [], {}
    start = (run.sampler.epoch, run.sampler.index)
    reward_seconds = 0.0
    if run.partials is not None:
        run.partials.begin_step(run.state.weight_version)
    while batch.sampling_rounds < (algorithm.max_sampling_rounds if algorithm.dynamic_sampling else 1):
        if run.partials is not None:  # the groups finished first, carried ones before new ones
            prompts, round_generations = run.partials.round(run.parts.rollout, run.sampler, sampling,
                                                            wanted - len(batch.samples) // group_size, recover)
        else:
            prompts = run.sampler.next_batch()
            round_generations = run.maker.samples(run.parts.rollout, prompts, sampling, group_size, recover=recover)
        reward_start = time.perf_counter()
        scored = score_groups([p.record for p in prompts], round_generations, group_size, run.assets.tokenizer,
                              run.rewards.score, algorithm.overlong_penalty, config.rollout.max_new_tokens)
        reward_seconds += time.perf_counter() - reward_start
        check_reward_errors(scored, config.reward.max_error_fraction, step)
        if algorithm.dynamic_sampling:
            scored.samples, scored.filtered_groups = drop_uniform_groups(scored.samples, group_size)
        batch.merge(scored)
        batch.sampling_rounds += 1
        generations += round_generations
        if len(batch.samples) >= wanted * group_size:
            break
    batch.samples = batch.samples[:wanted * group_size]
    if algorithm.dynamic_sampling:
        metrics.update(filtered_groups=batch.filtered_groups, sampling_rounds=batch.sampling_rounds,
                       train_groups=len(batch.samples) // group_size)
    metrics["reward_s"] = reward_seconds  # of the generate phase (or of the overlapped batch), scoring
    if run.partials is not None:
        metrics.update(run.partials.step_metrics([s.generation for s in batch.samples], run.state.weight_version))
    return StepBatch(batch, generations, metrics, start, (run.sampler.epoch, run.sampler.index))


class BatchesAhead:
    """rollout.max_staleness=N > 0: the batches of the next N steps are generated and scored, one
    after the other, in a background thread while the trainer trains (asynchronous, off-policy by
    at most N weight versions: the batch of step t is drawn once step t - N's was taken, when the
    engines hold version t - N or later). The engines take new weights between requests
    (`RolloutManager.weights_updating`), so a sample's tokens all come from one version. If an
    engine dies meanwhile, the batches ahead are dropped, their prompts drawn again and the batch
    generated in the loop's thread, which restarts the engine. Batches still ahead when the run
    stops or checkpoints are not saved: their prompts are drawn again after a resume (the
    checkpoint's data position is the one after the batch just trained)."""

    def __init__(self, run: Run, sampling, steps_ahead: int):
        self.run, self.sampling, self.steps_ahead = run, sampling, steps_ahead
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="batches-ahead")
        self._pending: list[Future] = []  # oldest first; the thread draws their prompts in this order
        self._next_step = 0
        self._after_taken: tuple[int, int] | None = None  # data position after the last batch trained

    def start(self, step: int, step_start: float) -> None:
        """Put the batches of the steps up to `step + steps_ahead - 1` ahead (those not yet)."""
        if not self._pending:  # the thread is idle: the sampler stands after the batch just drawn
            self._after_taken = (self.run.sampler.epoch, self.run.sampler.index)
        self._next_step = max(self._next_step, step)
        while len(self._pending) < self.steps_ahead and self._next_step < self.run.config.trainer.total_steps:
            self._pending.append(self._executor.submit(self._collect, self._next_step, step_start))
            self._next_step += 1

    def _collect(self, step: int, step_start: float) -> StepBatch:
        began = time.perf_counter()
        batch = collect_step_batch(self.run, self.sampling, step, recover=False)
        # On the row of the step that trains it: how long it generated, and when, from the start
        # of the step during which it was put ahead.
        batch.metrics.update(prefetch_start_s=max(began - step_start, 0.0), prefetch_s=time.perf_counter() - began)
        return batch

    def take(self, row: dict, trainer_version: int) -> StepBatch | None:
        """The oldest batch ahead (waiting for it counts as `generate`), without its groups that
        hold a sample more than max_staleness versions older than the trainer (counted); None when
        there is none, or when its generation hit a dead engine (every batch ahead is dropped)."""
        if not self._pending:
            return None
        future = self._pending.pop(0)
        try:
            with self.run.phase(row, "rollout", "generate"):
                batch = future.result()
        except (RayError, EngineCallFailed) as error:
            if not is_engine_death(getattr(error, "error", error)):
                raise
            self._drop_pending()
            return None
        self._after_taken = batch.end
        batch.scored.samples, dropped = drop_stale_groups(
            batch.scored.samples, self.run.config.rollout.n_samples_per_prompt, trainer_version, self.steps_ahead)
        batch.metrics["stale_dropped_samples"] = dropped
        return batch

    def _drop_pending(self) -> None:
        """Wait for every batch ahead and drop it; the sampler goes back to where the first one began."""
        for future in self._pending:
            try:
                future.result()
            except BaseException:  # noqa: BLE001 - the batch is dropped either way
                pass
        self._pending.clear()
        if self._after_taken is not None:
            self.run.sampler.restore(*self._after_taken)
        self._next_step = 0  # re-put ahead from the step the loop asks for next

    def close(self) -> None:
        """Drop the batches ahead (the data position goes back to the first one's start) and stop the thread."""
        self._drop_pending()
        self._executor.shutdown(wait=True)


def _staleness(generations: list, trainer_version: int, max_staleness: int) -> dict:
    """How many weight versions behind the trainer the step's samples were: the mean, and the
    share of samples at each age 0..max_staleness (staleness_0, staleness_1, ...)."""
    ages = [trainer_version - g.weight_version for g in generations]
    count = max(len(ages), 1)
    return {"staleness_mean": sum(ages) / count,
            **{f"staleness_{age}": sum(a == age for a in ages) / count for age in range(max_staleness + 1)}}


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


def _train_resuming_dead_trainers(run: Run, store: CheckpointStore) -> None:
    """`train_loop`; when a trainer rank dies, the trainer group restarts from the latest
    checkpoint (at most checkpoint.max_auto_resumes times) and the loop goes on from there."""
    for resumes in itertools.count():
        try:
            return train_loop(run)
        except (RayError, TrainerHang) as error:
            checkpoint, _ = store.latest_loadable()
            if resumes >= run.config.checkpoint.max_auto_resumes or checkpoint is None:
                raise
            group = run.parts.trainer
            if isinstance(error, TrainerHang):  # a stuck rank is handled as a dead one (its stacks are kept)
                logger.warning("%s; restarting the trainers from %s (%d of %d)", error, checkpoint, resumes + 1,
                               run.config.checkpoint.max_auto_resumes)
            else:
                dead = [rank["rank"] for rank in group.health(timeout_s=10) if not rank["alive"]]
                if not dead:
                    raise
                cause = getattr(error, "cause", None) or error
                where = ", ".join(f"rank {rank} on node {group.nodes[rank]}" for rank in dead)
                logger.warning("a trainer rank died (%s; %s); restarting the trainers from %s (%d of %d)",
                               type(cause).__name__, where, checkpoint, resumes + 1,
                               run.config.checkpoint.max_auto_resumes)
            # A rank killed between /begin_weight_update and /end_weight_update leaves the engines'
            # session open, and they would refuse the next sync.
            run.parts.rollout.end_abandoned_weight_updates()
            restart_trainers(run.config, run.parts)
            logger.info("trainer ranks are back, on node(s) %s", ", ".join(sorted(set(run.parts.trainer.nodes))))
            run.continue_from(checkpoint)
            run.trainer_restarts = resumes + 1


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


# ---- the run's life ---------------------------------------------------------------------------

def with_absolute_paths(config: RunConfig, run_dir: str) -> RunConfig:
    """The config with run_dir, the model's, the data's and the user functions' file paths made
    absolute: trainers and engines on other nodes (or in another working directory) must not resolve
    them against their own, and RUN_DIR/config.yaml must run again from anywhere. A function named
    as a module (`package.module:function`) is left as it is: it is found on the Python path."""

    def absolute(path: str | None) -> str | None:
        return str(Path(path).absolute()) if path else path

    model = config.model.model_copy(update={"path": absolute(config.model.path),
                                            "tokenizer_path": absolute(config.model.tokenizer_path)})
    data = config.data.model_copy(update={"train_path": absolute(config.data.train_path),
                                          "eval_path": absolute(config.data.eval_path)})
    reward = config.reward.model_copy(update={"function": absolute_function_path(config.reward.function)})
    rollout = config.rollout.model_copy(update={
        "generate_function": absolute_function_path(config.rollout.generate_function)})
    eval_sets = [eval_set.model_copy(update={"path": absolute(eval_set.path),
                                             "reward_function": absolute_function_path(eval_set.reward_function)})
                 for eval_set in config.eval.datasets]
    return config.model_copy(update={
        "run_dir": str(Path(run_dir).absolute()), "model": model, "data": data, "reward": reward, "rollout": rollout,
        "eval": config.eval.model_copy(update={"datasets": eval_sets})})


def absolute_function_path(import_path: str | None) -> str | None:
    """`path/to/file.py:function` with the file's path made absolute; other forms as they are."""
    if not import_path:
        return import_path
    module, sep, attribute = import_path.rpartition(":")
    if not sep or not module.endswith(".py"):
        return import_path
    return f"{Path(module).absolute()}:{attribute}"


def prepare_run_dir(config: RunConfig, run_dir: Path, resuming: bool) -> None:
    if not resuming and (run_dir / "metrics.jsonl").exists():
        raise RunFailed(
            f"run directory {run_dir} already holds a run (metrics.jsonl) and no checkpoint to resume; "
            "choose another run_dir, or pass --resume to continue a checkpointed run"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_config(config.model_copy(update={"run_dir": str(run_dir)}), run_dir / "config.yaml")


def _first_lines(text: str, count: int) -> str:
    lines = text.splitlines()
    return "\n".join(lines[:count] + (["..."] if len(lines) > count else []))


@contextmanager
def _failures_reported(status: RunStatus):
    """Any error ends the run as `failed` in the status; a dead or raising actor becomes RunFailed."""
    try:
        yield
    except BaseException as error:
        failure = disk_full_failure(error, Path(status.run_dir))  # in this process or in an actor
        if failure is not None:
            message = str(failure)
        elif isinstance(error, TrainerHang):
            message = str(error)
            failure = RunFailed(message)
        elif isinstance(error, (RayError, EngineRestartLimit)):
            cause = getattr(error, "cause", None) or error  # the remote exception, without Ray's wrapping
            message = f"{type(cause).__name__}: {_first_lines(str(cause), 40)}"
            failure = RunFailed(f"a trainer rank or rollout engine failed: {message}")
        else:
            message = f"{type(error).__name__}: {error}"
        status.fail(message)
        try:
            status.save_snapshot()
        except OSError as unsaved:  # reported, but the run's own error stays the one that ends it
            logger.warning("could not record the failure in status.json: %s", unsaved)
        if failure is None:
            raise
        raise failure from error


class StoppedAtOnce(SystemExit):
    """A second stop signal: the run ends inside its step, without a checkpoint (exit 128 + signal)."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signal_name = _signal_name(signum)

    def __str__(self) -> str:
        return f"stopped at once by a second {self.signal_name}, without a checkpoint"


def _signal_name(signum: int) -> str:
    return "SIGINT (Ctrl-C)" if signum == signal.SIGINT else signal.Signals(signum).name


def _stop_on_signals(status: RunStatus) -> None:
    """SIGTERM, or SIGINT (Ctrl-C), stops the run as POST /api/v1/stop does: after the current
    step, with a checkpoint. A second one stops at once (engines and trainers are still shut down).
    The processes a signal to the whole process group also reaches never receive it
    (rlsys.system.interrupts)."""
    def _stop(signum, frame):
        if status.stop_requested:
            raise StoppedAtOnce(signum)
        logger.info("%s: stopping after this step, with a checkpoint (again to stop at once)", _signal_name(signum))
        status.request("stop")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)


def _describe_data(assets: RunAssets) -> str:
    dropped = []
    if assets.skipped_rows:
        dropped.append(f"{assets.skipped_rows} invalid rows skipped")
    if assets.too_long_prompts:
        dropped.append(f"{assets.too_long_prompts} prompts longer than the context window dropped")
    sets = ", ".join(f"{s.config.name} ({len(s.prompts)} prompts)" for s in assets.eval_sets)
    return (f"{len(assets.train)} train and {len(assets.eval)} eval prompts"
            + (f" ({', '.join(dropped)})" if dropped else "") + (f"; eval sets: {sets}" if sets else ""))


def _describe_rewards(config: RunConfig) -> str:
    if config.reward.url:
        return f"the reward service at {config.reward.url} (reward.function is not used)"
    return f"{config.reward.function} in {config.reward.num_workers} worker process(es)"


def run(config: RunConfig) -> Path:
    """Run GRPO to completion (or continue one, with checkpoint.resume: auto)."""
    check_backends_installed(config.logging.backends)
    run_start = time.perf_counter()
    config = resolve_model_paths(config)  # a hub id becomes its snapshot directory, at one commit
    if config.model.hub_id:
        logger.info("model %s at commit %s: %s", config.model.hub_id, config.model.revision, config.model.path)
    assets = load_assets(config)  # every input check happens before any actor starts
    maker = SampleMaker(config, assets.tokenizer)  # loads rollout.generate_function, if any
    random.seed(config.seed)
    config = with_absolute_paths(config, config.run_dir or f"runs/{datetime.now():%Y%m%d-%H%M%S}")
    run_dir = Path(config.run_dir)
    store = CheckpointStore(run_dir, config.checkpoint.keep_last)
    checkpoint = checkpoint_to_resume(store) if config.checkpoint.resume == "auto" else None
    if checkpoint is not None:
        refuse_incompatible_checkpoint(checkpoint, config)
    lock = RunDirLock(run_dir)
    lock.acquire()  # before anything is written there
    try:
        prepare_run_dir(config, run_dir, resuming=checkpoint is not None)
        log = MetricsLog(run_dir / "metrics.jsonl")  # a bad line is refused here, before anything starts
    except BaseException:
        lock.release()
        raise
    logger.info("run directory %s", run_dir.resolve())
    logger.info("data: %s", _describe_data(assets))
    if note := repeated_prompts_note(config.data.prompts_per_step, len(assets.train)):
        logger.info("%s", note)
    if checkpoint is not None:
        logger.info("resuming from %s", checkpoint)
    status = new_status(config, run_dir, assets, resuming=checkpoint is not None)
    layout = Topology.from_config(config, has_gpu=False)  # CPU counts do not depend on the GPUs
    with ExitStack() as stack:
        stack.callback(lock.release)
        sweep_shared_memory()  # what runs killed without warning left on this machine
        stack.callback(sweep_shared_memory)  # and, at the end, what a killed engine left of this run
        stack.callback(start_reaper(run_dir).terminate)  # cleans up if this process is killed
        dashboard = stack.enter_context(status_server(config, status))
        trackers = Trackers(config.logging.backends, run_dir, config.model_dump(mode="json"), config.logging.project,
                            config.logging.run_name or run_dir.resolve().name)
        stack.callback(trackers.close)
        ray_start = time.perf_counter()
        # Standing engines (rollout.attach) live in a cluster that outlives runs: this machine's when no address is set.
        address = cluster_address(config) if config.rollout.attach else config.placement.ray_address
        stack.enter_context(ray_cluster(address, config.placement.num_cpus or layout.local_cpus(),
                                        layout.custom_resources()))
        logger.info("Ray cluster up in %.1f s", time.perf_counter() - ray_start)
        _stop_on_signals(status)  # after ray.init, which installs a SIGTERM handler of its own
        stack.enter_context(_failures_reported(status))  # entered before the components: reports after they stop
        topology = Topology.from_config(config, run_uses_gpus(config, layout))
        rewards = make_reward_scorer(config.reward)
        logger.info("rewards from %s", _describe_rewards(config))
        stack.callback(rewards.close)
        rewards.start()  # its workers load the reward function while the engines start
        parts = start_components(config, topology, run_dir, stack)
        parts.hangs = HangReporter(run_dir, parts, lambda: run.state.next_step if run is not None else 0, status)
        parts.trainer.on_hang = parts.hangs.on_trainer_hang
        status.stacks_provider = parts.hangs.on_request
        parts.rollout.on_silent = lambda index, why: parts.hangs.collect_safely(f"engine-{index} stopped after {why}")
        stack.callback(setattr, status, "stacks_provider", None)  # before the processes it reads stop
        run = None
        evaluator = Evaluator(config, assets, parts.rollout, rewards.score, maker)
        stack.callback(evaluator.close)  # the reward workers of eval sets with a reward function of their own
        partials = PartialRollouts(config) if config.rollout.partial_rollouts else None
        run = Run(config, assets, parts, CoordinatorState(0, 0, 0, 0), status, log,
                  PromptSampler(assets.train, config.data.prompts_per_step, config.seed), evaluator,
                  Checkpointer(store, config.checkpoint.interval, config.trainer.total_steps, parts,
                               partials.saved if partials else None),
                  HealthMonitor(parts), rewards, trackers, maker, partials)
        parts.rollout.on_restart = lambda index: bring_engines_up_to_date(config, parts, run.trainer_version)
        sync_start = time.perf_counter()
        run.continue_from(checkpoint)
        logger.info("engines hold the trainer's weights (version %d) after %.1f s", run.state.weight_version,
                    time.perf_counter() - sync_start)
        logger.info("training (started in %.0f s)%s", time.perf_counter() - run_start,
                    f"; dashboard at {dashboard}/" if dashboard else "")
        _train_resuming_dead_trainers(run, store)
        status.set_state("stopped" if status.stop_requested else "finished")
        status.save_snapshot()
    logger.info("%s; metrics in %s", status.state, (run_dir / "metrics.jsonl").resolve())
    return run_dir
