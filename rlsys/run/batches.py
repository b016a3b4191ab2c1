"""Where a step's batch comes from: the one interface the loop calls once per step.

Two choices make a run's batches, each behind a small interface, both made by the run's rollout
mode (its runner, rlsys/run/rollout_modes/):
- **Rounds** (its Protocol in rlsys/run/run_state.py), how one round of groups is generated:
  `OnPolicyRounds` here (new prompts each round, every sample from the engines' current weights),
  or the partial mode's groups carried between steps.
- **Step batches**, when a step's batch is generated: `StepBatches` here (at the step's start, in
  the loop's thread), or the async mode's batches ahead of the trainer.
`collect_step_batch` runs the rounds of one step (dynamic sampling may need several) and scores
them; the loop only calls `take`, `before_training`, `metrics` and `close` of its step batches.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from rlsys.algorithms.samples import ScoredBatch, check_reward_errors, score_groups
from rlsys.algorithms.shaping import drop_uniform_groups
from rlsys.data.datasets import PromptSampler
from rlsys.records import EncodedPrompt, Generation, SamplingParams
from rlsys.rollout.manager import RolloutManager
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
                           "rollout.mode partial their prompts are not trained", len(saved))


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

    def take(self, step: int, trainer_version: int) -> StepBatch:
        """The step's batch (the loop counts the time it takes as the step's `generate` phase)."""
        return collect_step_batch(self.run, self.sampling, step)

    def before_training(self, step: int, step_start: float) -> None:
        """The step's batch is taken and evaluated; the trainer trains next."""

    def metrics(self, batch: StepBatch, trainer_version: int) -> dict:
        """What the step's row says of how its batch was made, once it trained."""
        return {}

    def close(self) -> None:
        pass
