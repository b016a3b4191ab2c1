"""Reward shaping and sample filtering: what the algorithm adds to the task's reward (overlong
penalty, KL in reward) and which samples or tokens it trains on (dynamic sampling, truncation
mask). Each works on the step's `Sample` records (rlsys/records.py); `Sample.score` = reward +
shaping is what advantages are computed from.
"""

from __future__ import annotations

from rlsys.algorithms.grpo import overlong_penalty
from rlsys.config import OverlongPenaltyConfig
from rlsys.records import Sample


# score += -factor * min(len - (max_new_tokens - buffer), buffer) / buffer   when len > max_new_tokens - buffer
def add_overlong_penalty(sample: Sample, overlong: OverlongPenaltyConfig, max_new_tokens: int) -> float:
    """DAPO's soft overlong punishment added to one sample's shaping; the penalty."""
    penalty = overlong_penalty(len(sample.generation.response_ids), max_new_tokens, overlong.buffer_tokens,
                               overlong.factor)
    sample.shaping += penalty
    return penalty


# score -= kl_coef * sum_t KL_t(policy || reference)
def add_kl_penalty(samples: list[Sample], sequence_kls: list[float], kl_coef: float) -> dict:
    """KL in reward: each sample's summed KL estimate (one float per sample) off its shaping; the metric."""
    for sample, kl in zip(samples, sequence_kls, strict=True):
        sample.shaping -= kl_coef * kl
    return {"kl_reward_penalty": kl_coef * sum(sequence_kls) / max(len(sequence_kls), 1)}


# keep group g  iff  |{score_i : i in g}| > 1   (all-equal scores give every advantage 0)
def drop_uniform_groups(samples: list[Sample], group_size: int) -> tuple[list[Sample], int]:
    """Dynamic sampling: the samples of the groups whose scores differ, and how many groups were dropped."""
    kept, dropped = [], 0
    for start in range(0, len(samples), group_size):
        group = samples[start:start + group_size]
        if len({sample.score for sample in group}) > 1:
            kept += group
        else:
            dropped += 1
    return kept, dropped


def drop_stale_groups(samples: list[Sample], group_size: int, trainer_version: int,
                      max_staleness: int) -> tuple[list[Sample], int]:
    """Bounded staleness: the samples of the groups none of whose samples came from weights more
    than `max_staleness` versions behind the trainer's, and how many samples the dropped groups held
    (a group is kept or dropped whole: its advantages are relative to each other)."""
    kept, dropped = [], 0
    for start in range(0, len(samples), group_size):
        group = samples[start:start + group_size]
        if all(trainer_version - s.generation.weight_version <= max_staleness for s in group):
            kept += group
        else:
            dropped += len(group)
    return kept, dropped


# mask_t = 0 for every response token of a truncated sample (mask_truncated), else the generation's own
def loss_mask(sample: Sample, mask_truncated: bool) -> list[int] | None:
    """Per response token 1 = in the loss, 0 = not (a trajectory's injected tokens; with
    `mask_truncated` all of a truncated response's); None: every token counts."""
    if mask_truncated and sample.truncated:
        return [0] * len(sample.generation.response_ids)
    return sample.generation.loss_mask
