"""rollout.mode partial: the groups in flight between steps, and how a step takes its groups.

A step puts `data.prompts_per_step + oversample` groups in flight (those carried from
earlier steps first, then new prompts), stops once `prompts_per_step` of them are finished and
aborts the rest (RolloutManager.generate_groups). The finished groups, oldest first, are the
step's batch; the others are carried: their samples continue at the next step with the weights
then current. A sample is trained once, when its whole group is finished, and the groups carried
are saved in every checkpoint (coordinator.json), so none is lost or trained twice across a
resume.
"""

from __future__ import annotations

import logging

from rlsys.config import PartialMode, RunConfig
from rlsys.data.datasets import PromptSampler
from rlsys.records import EncodedPrompt, Generation, SamplingParams
from rlsys.rollout.manager import RolloutManager
from rlsys.rollout.partial import GroupInFlight, group_from_json, group_to_json
from rlsys.run.generation import SampleMaker
from rlsys.run.rollout_modes.base import ModeRunner, runs_mode

logger = logging.getLogger(__name__)


@runs_mode(PartialMode)
class PartialRunner(ModeRunner):
    mode: PartialMode

    def rounds(self, config: RunConfig, maker: SampleMaker) -> PartialRollouts:
        return PartialRollouts(self.mode, config.rollout.n_samples_per_prompt, config.data.prompts_per_step)


class PartialRollouts:
    def __init__(self, mode: PartialMode, group_size: int, prompts_per_step: int):
        self.group_size = group_size
        self.oversample = mode.groups_in_flight(prompts_per_step) - prompts_per_step
        self.max_age = mode.max_age
        self.groups: list[GroupInFlight] = []  # carried from earlier steps, oldest first
        self._step: dict = {}

    # ---- checkpoint --------------------------------------------------------------------------
    def saved(self) -> list[dict]:
        return [group_to_json(group) for group in self.groups]

    def restore(self, saved: list[dict] | None) -> None:
        """The groups a checkpoint carried (none for a fresh run)."""
        self.groups = [group_from_json(data) for data in saved or []]
        wrong = [g for g in self.groups if len(g.samples) != self.group_size]
        if wrong:  # the checkpoint was made with another rollout.n_samples_per_prompt
            logger.warning("%d group(s) carried by the checkpoint's partial rollouts have %d samples, not "
                           "rollout.n_samples_per_prompt=%d: generated again from their prompts", len(wrong),
                           len(wrong[0].samples), self.group_size)
            for group in wrong:
                group.samples = [None] * self.group_size

    # ---- a step ------------------------------------------------------------------------------
    def begin_step(self, trainer_version: int) -> None:
        """Before the step's first round: samples older than the mode's max_age start again."""
        discarded = 0
        if self.max_age is not None:
            for group in self.groups:
                discarded += group.restart_older_than(trainer_version - self.max_age)
        self._step = {"partial_groups_carried_in": len(self.groups),
                      "partial_samples_continued": sum(g.partial_samples() for g in self.groups),
                      "partial_tokens_discarded": discarded, "aborted_samples": 0}

    def round(self, rollout: RolloutManager, sampler: PromptSampler, sampling: SamplingParams, wanted: int,
              recover: bool) -> tuple[list[EncodedPrompt], list[Generation]]:
        """`wanted` finished groups (prompts, and their generations grouped prompt by prompt): the
        carried groups, topped up with new prompts to wanted + oversample in flight."""
        lacking = wanted + self.oversample - len(self.groups)
        self.groups += [GroupInFlight.new(prompt, self.group_size) for prompt in sampler.next_prompts(max(0, lacking))]
        self._step["aborted_samples"] += rollout.generate_groups(self.groups, wanted, sampling, recover=recover)
        taken = [group for group in self.groups if group.finished][:wanted]
        self.groups = [group for group in self.groups if not any(group is t for t in taken)]
        return [group.prompt for group in taken], [sample for group in taken for sample in group.samples]

    def step_metrics(self, trained: list[Generation], trainer_version: int) -> dict:
        """What the step carried in and out, and how old its trained samples' oldest tokens are."""
        ages = [trainer_version - g.weight_version for g in trained]
        return {**self._step,
                "partial_groups_carried": len(self.groups),
                "partial_samples_carried": sum(len(g.unfinished()) for g in self.groups),
                "partial_age_mean": sum(ages) / max(len(ages), 1), "partial_age_max": max(ages, default=0)}
