"""Where a step's batch comes from: the one interface the loop calls once per step.

Two choices make a run's batches, each behind a small interface:
- **Rounds** (its Protocol in rlsys/run/run_state.py), how one round of groups is generated:
  `OnPolicyRounds` (new prompts each round, every sample from the engines' current weights) or
  `PartialRollouts` (rollout.partial_rollouts, rlsys/run/partial_rollouts.py: groups carried
  between steps, continued with newer weights).
- **Step batches**, when a step's batch is generated: `StepBatches` (at the step's start, in the
  loop's thread) or `BatchesAhead` (rollout.max_staleness = N: the next N steps' batches in a
  background thread while the trainer trains).
`collect_step_batch` runs the rounds of one step (dynamic sampling may need several) and scores
them; the loop only calls `take`, `before_training`, `metrics` and `close` of `step_batches(...)`.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from ray.exceptions import RayError

from rlsys.algorithms.samples import ScoredBatch, check_reward_errors, score_groups
from rlsys.algorithms.shaping import drop_stale_groups, drop_uniform_groups
from rlsys.data.datasets import PromptSampler
from rlsys.records import EncodedPrompt, Generation, SamplingParams
from rlsys.rollout.manager import EngineCallFailed, RolloutManager, is_engine_death
from rlsys.run.generation import SampleMaker
from rlsys.run.run_state import Run

logger = logging.getLogger(__name__)


# ---- rounds -----------------------------------------------------------------------------------

class OnPolicyRounds:
    """Each round: data.prompts_per_step new prompts, n samples each from the engines' weights
    (rollout.generate_function's trajectories when one is set: `SampleMaker`)."""

    def __init__(self, maker: SampleMaker, group_size: int):
        self.maker, self.group_size = maker, group_size

    def begin_step(self, trainer_version: int) -> None:
        pass

    def round(self, rollout: RolloutManager, sampler: PromptSampler, sampling: SamplingParams, wanted: int,
              recover: bool) -> tuple[list[EncodedPrompt], list[Generation]]:
        prompts = sampler.next_batch()  # a whole batch even when fewer are wanted: dynamic sampling drops some
        return prompts, self.maker.samples(rollout, prompts, sampling, self.group_size, recover=recover)

    def step_metrics(self, trained: list[Generation], trainer_version: int) -> dict:
        return {}

    def saved(self) -> None:
        return None

    def restore(self, saved: list[dict] | None) -> None:
        if saved:
            logger.warning("the checkpoint carries %d partial-rollout group(s) in flight; without "
                           "rollout.partial_rollouts their prompts are not trained", len(saved))


# ---- one step's batch -------------------------------------------------------------------------

@dataclass
class StepBatch:
    """One step's scored groups, every generation made for it, and where the data stood."""

    scored: ScoredBatch
    generations: list
    metrics: dict
    start: tuple[int, int]  # (data epoch, index) before its prompts were drawn
    end: tuple[int, int]  # and after


def collect_step_batch(run: Run, sampling: SamplingParams, step: int, recover: bool = True) -> StepBatch:
    """Prompts -> engine samples -> rewards, one round of data.prompts_per_step groups. With
    algorithm.dynamic_sampling, groups whose scores are all equal are dropped and more rounds run
    until the step has prompts_per_step groups (surplus groups are dropped too) or
    algorithm.max_sampling_rounds is reached."""
    config, algorithm, rounds = run.config, run.config.algorithm, run.rounds
    group_size, wanted = config.rollout.n_samples_per_prompt, config.data.prompts_per_step
    batch, generations, metrics = ScoredBatch(samples=[], sampling_rounds=0), [], {}
    start = (run.sampler.epoch, run.sampler.index)
    reward_seconds = 0.0
    rounds.begin_step(run.state.weight_version)
    while batch.sampling_rounds < (algorithm.max_sampling_rounds if algorithm.dynamic_sampling else 1):
        prompts, round_generations = rounds.round(run.parts.rollout, run.sampler, sampling,
                                                  wanted - len(batch.samples) // group_size, recover)
        reward_start = time.perf_counter()
        scored = score_groups([p.record for p in prompts], round_generations, group_size, run.assets.tokenizer,
                              run.rewards.score, algorithm.overlong_penalty, config.rollout.max_new_tokens,
                              config.reward.skip_special_tokens)
        reward_seconds += time.perf_counter() - reward_start
        run.reward_error_log.note(step, scored)
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
    metrics.update(rounds.step_metrics([s.generation for s in batch.samples], run.state.weight_version))
    return StepBatch(batch, generations, metrics, start, (run.sampler.epoch, run.sampler.index))


# ---- when a step's batch is generated ---------------------------------------------------------

class StepBatches:
    """Each step's batch generated at its start, in the loop's thread (on-policy, or partial
    rollouts' carried groups): what the loop calls once per step."""

    def __init__(self, run: Run, sampling: SamplingParams):
        self.run, self.sampling = run, sampling

    def take(self, row: dict, step: int, trainer_version: int) -> StepBatch:
        """The step's batch; the time it takes counts as the step's `generate` phase."""
        with self.run.phase(row, "rollout", "generate"):
            return collect_step_batch(self.run, self.sampling, step)

    def before_training(self, step: int, step_start: float) -> None:
        """The step's batch is taken and evaluated; the trainer trains next."""

    def metrics(self, batch: StepBatch, trainer_version: int) -> dict:
        """What the step's row says of how its batch was made, once it trained."""
        return {}

    def close(self) -> None:
        pass


class BatchesAhead(StepBatches):
    """rollout.max_staleness=N > 0: the batches of the next N steps are generated and scored, one
    after the other, in a background thread while the trainer trains (asynchronous, off-policy by
    at most N weight versions: the batch of step t is drawn once step t - N's was taken, when the
    engines hold version t - N or later). The engines take new weights between requests
    (`RolloutManager.weights_updating`), so a sample's tokens all come from one version. If an
    engine dies meanwhile, the batches ahead are dropped, their prompts drawn again and the batch
    generated in the loop's thread, which restarts the engine. Batches still ahead when the run
    stops or checkpoints are not saved: their prompts are drawn again after a resume (the
    checkpoint's data position is the one after the batch just trained)."""

    def __init__(self, run: Run, sampling: SamplingParams, steps_ahead: int):
        super().__init__(run, sampling)
        self.steps_ahead = steps_ahead
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="batches-ahead")
        self._pending: list[Future] = []  # oldest first; the thread draws their prompts in this order
        self._next_step = 0
        self._after_taken: tuple[int, int] | None = None  # data position after the last batch trained

    def take(self, row: dict, step: int, trainer_version: int) -> StepBatch:
        """The oldest batch ahead (waiting for it counts as `generate`), without its groups that
        hold a sample more than max_staleness versions older than the trainer (counted). With none
        ahead, or when their generation hit a dead engine (every batch ahead is dropped), the step's
        batch is generated here, where a dead engine is restarted."""
        batch = self._take_ahead(row, trainer_version)
        return batch if batch is not None else super().take(row, step, trainer_version)

    def _take_ahead(self, row: dict, trainer_version: int) -> StepBatch | None:
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

    def before_training(self, step: int, step_start: float) -> None:
        """Put the batches of the next steps ahead, up to `step + steps_ahead` (those not yet):
        they generate while this step trains."""
        if not self._pending:  # the thread is idle: the sampler stands after the batch just drawn
            self._after_taken = (self.run.sampler.epoch, self.run.sampler.index)
        self._next_step = max(self._next_step, step + 1)
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

    def metrics(self, batch: StepBatch, trainer_version: int) -> dict:
        return staleness(batch.generations, trainer_version, self.steps_ahead)

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


def staleness(generations: list, trainer_version: int, max_staleness: int) -> dict:
    """How many weight versions behind the trainer the step's samples were: the mean, and the
    share of samples at each age 0..max_staleness (staleness_0, staleness_1, ...)."""
    ages = [trainer_version - g.weight_version for g in generations]
    count = max(len(ages), 1)
    return {"staleness_mean": sum(ages) / count,
            **{f"staleness_{age}": sum(a == age for a in ages) / count for age in range(max_staleness + 1)}}


def step_batches(run: Run, sampling: SamplingParams) -> StepBatches:
    """The run's step batches: ahead of the trainer with rollout.max_staleness, else at each step's start."""
    if run.config.rollout.max_staleness:
        return BatchesAhead(run, sampling, run.config.rollout.max_staleness)
    return StepBatches(run, sampling)
