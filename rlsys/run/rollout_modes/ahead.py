"""rollout.mode async (max_staleness = N): the batches of the next N steps generated in a background
thread while the trainer trains."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

from ray.exceptions import RayError

from rlsys.algorithms.shaping import drop_stale_groups
from rlsys.config import AsyncMode
from rlsys.records import SamplingParams
from rlsys.rollout.fleet import EngineCallFailed, is_engine_death
from rlsys.run.batches import StepBatch, StepBatches, collect_step_batch
from rlsys.run.rollout_modes.base import ModeRunner, runs_mode
from rlsys.run.run_state import Run


@runs_mode(AsyncMode)
class AsyncRunner(ModeRunner):
    mode: AsyncMode

    def step_batches(self, run: Run, sampling: SamplingParams) -> StepBatches:
        return BatchesAhead(run, sampling, self.mode.max_staleness)


class BatchesAhead(StepBatches):
    """rollout.mode async, max_staleness=N: the batches of the next N steps are generated and scored, one
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

    def take(self, step: int, trainer_version: int) -> StepBatch:
        """The oldest batch ahead (waiting for it counts as `generate`), without its groups that
        hold a sample more than max_staleness versions older than the trainer (counted). With none
        ahead, or when their generation hit a dead engine (every batch ahead is dropped), the step's
        batch is generated here, where a dead engine is restarted."""
        batch = self._take_ahead(trainer_version)
        return batch if batch is not None else super().take(step, trainer_version)

    def _take_ahead(self, trainer_version: int) -> StepBatch | None:
        if not self._pending:
            return None
        future = self._pending.pop(0)
        try:
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
