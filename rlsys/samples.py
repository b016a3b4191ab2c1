"""From engine generations to scored, advantage-weighted training sequences."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlsys.actors.batching import TrainSequence
from rlsys.algorithms.grpo import group_advantages
from rlsys.data import PromptRecord
from rlsys.errors import RunFailed
from rlsys.reward_pool import RewardCall, RewardOutcome
from rlsys.rollout.engine import Generation


@dataclass
class Sample:
    record: PromptRecord
    generation: Generation
    response_text: str
    reward: float = 0.0
    advantage: float = 0.0


@dataclass
class ScoredBatch:
    samples: list[Sample]  # only complete groups whose rewards all computed
    num_generations: int = 0  # every generation scored, kept or not
    reward_errors: int = 0
    first_error: str | None = None
    dropped_groups: int = 0

    def reward_metrics(self) -> dict:
        """Task rewards of the samples kept, and what the reward function failed on."""
        rewards = [s.reward for s in self.samples]
        mean = sum(rewards) / max(len(rewards), 1)
        return {
            "reward_mean": mean,
            "reward_std": (sum((r - mean) ** 2 for r in rewards) / max(len(rewards), 1)) ** 0.5,
            "reward_errors": self.reward_errors,
            "dropped_groups": self.dropped_groups,
        }


def response_text(tokenizer, response_ids: list[int]) -> str:
    """Decode up to (not including) the first end-of-sequence token, special tokens kept."""
    eos = tokenizer.eos_token_id
    if eos in response_ids:
        response_ids = response_ids[: response_ids.index(eos)]
    return tokenizer.decode(response_ids, skip_special_tokens=False)


Scorer = Callable[[list[RewardCall]], list[RewardOutcome]]  # e.g. RewardPool.score


def score_groups(
    records: list[PromptRecord], generations: list[Generation], group_size: int, tokenizer, scorer: Scorer,
) -> ScoredBatch:
    """Reward every sample; a group with any failing reward is dropped (and counted)."""
    texts = [response_text(tokenizer, g.response_ids) for g in generations]
    calls = [RewardCall(records[i // group_size].prompt, text, records[i // group_size].label,
                        records[i // group_size].metadata) for i, text in enumerate(texts)]
    outcomes = scorer(calls)
    batch = ScoredBatch(samples=[], num_generations=len(generations))
    for group_index, record in enumerate(records):
        group = range(group_index * group_size, (group_index + 1) * group_size)
        failed = [outcomes[i].error for i in group if outcomes[i].error is not None]
        batch.reward_errors += len(failed)
        if failed:
            batch.dropped_groups += 1
            batch.first_error = batch.first_error or failed[0]
            continue
        batch.samples.extend(Sample(record, generations[i], texts[i], reward=outcomes[i].value) for i in group)
    return batch


def check_reward_errors(scored: ScoredBatch, max_error_fraction: float, step: int) -> None:
    """Stop the run when more than `max_error_fraction` of a step's reward calls failed."""
    if scored.reward_errors > max_error_fraction * scored.num_generations:
        raise RunFailed(
            f"step {step}: {scored.reward_errors} of {scored.num_generations} rewards raised "
            f"(reward.max_error_fraction={max_error_fraction}); first error:\n{scored.first_error}"
        )


def assign_advantages(samples: list[Sample], group_size: int, normalize_by_std: bool) -> None:
    if not samples:
        return
    rewards = torch.tensor([s.reward for s in samples])
    for sample, advantage in zip(samples, group_advantages(rewards, group_size, normalize_by_std).tolist(), strict=False):
        sample.advantage = advantage


def to_train_sequences(samples: list[Sample]) -> list[TrainSequence]:
    return [
        TrainSequence(
            token_ids=s.generation.prompt_ids + s.generation.response_ids,
            prompt_len=len(s.generation.prompt_ids),
            advantage=s.advantage,
            engine_logprobs=s.generation.logprobs,
        )
        for s in samples
    ]
