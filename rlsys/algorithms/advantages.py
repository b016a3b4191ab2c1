"""Advantage estimators, registered by name (config: algorithm.advantage_estimator).

Each estimator maps the scores of equal-sized groups, laid out group by group as a [num_groups,
group_size] tensor, to one advantage per sample, the same shape. Adding one: a function here with
`@advantage_estimator(NAME)`, and NAME in AlgorithmConfig.advantage_estimator's Literal (the config
does not import torch; tests/unit/test_grpo.py checks that the two name the same estimators).

Scores are per sample (reward + shaping, KL in reward being the sequence's summed KL), so every
estimator gives one advantage per sample, shared by its tokens; "batch" statistics are over the
step's samples, each counted once (verl and OpenRLHF whiten REINFORCE++ over tokens, which weighs
a sample by its length).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlsys.records import Sample

AdvantageEstimator = Callable[[torch.Tensor, float], torch.Tensor]
ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def advantage_estimator(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Registers the decorated function as `algorithm.advantage_estimator: NAME`."""
    def register(estimator: AdvantageEstimator) -> AdvantageEstimator:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is registered twice")
        ADVANTAGE_ESTIMATORS[name] = estimator
        return estimator
    return register


# A_i = (r_i - mean(r_group)) / (std(r_group) + eps)   (GRPO; an all-equal group gets 0)
@advantage_estimator("group")
def group_normalised(grouped: torch.Tensor, eps: float) -> torch.Tensor:
    """[G, n] scores -> [G, n] advantages, each group centred and scaled by its own std."""
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    return centered / (grouped.std(dim=1, keepdim=True, unbiased=True) + eps)


# A_i = (r_i - mean(r_group)) / (std(r_batch) + eps)   (Lite PPO: group baseline, batch scale)
@advantage_estimator("batch")
def batch_normalised(grouped: torch.Tensor, eps: float) -> torch.Tensor:
    """[G, n] scores -> [G, n] advantages, each group centred, all scaled by the batch's std."""
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    batch_std = grouped.std(unbiased=True) if grouped.numel() > 1 else torch.zeros(())
    return centered / (batch_std + eps)


# A_i = r_i - mean(r_group)   (Dr. GRPO: no std scaling)
@advantage_estimator("none")
def group_centred(grouped: torch.Tensor, eps: float) -> torch.Tensor:
    """[G, n] scores -> [G, n] advantages, each group centred only (`eps` unused)."""
    return grouped - grouped.mean(dim=1, keepdim=True)


# A_i = r_i - mean_{j != i}(r_j) = n / (n - 1) * (r_i - mean(r_group))   (RLOO; needs n >= 2)
@advantage_estimator("rloo")
def leave_one_out(grouped: torch.Tensor, eps: float) -> torch.Tensor:
    """[G, n] scores -> [G, n] advantages, each score minus the mean of the rest of its group (`eps` unused)."""
    n = grouped.shape[1]
    if n < 2:
        raise ValueError(f"rloo needs at least 2 samples per group (got {n}); raise rollout.n_samples_per_prompt")
    # The scaled form: a group of equal scores gets exactly 0 (r - (sum - r) / (n - 1) can round off it).
    return n / (n - 1) * group_centred(grouped, eps)


# A_i = (r_i - mean(r_batch)) / (std(r_batch) + eps)   (REINFORCE++: no group baseline, global normalisation)
@advantage_estimator("reinforce++")
def batch_whitened(grouped: torch.Tensor, eps: float) -> torch.Tensor:
    """[G, n] scores -> [G, n] advantages, centred and scaled by the whole batch's mean and std."""
    batch_std = grouped.std(unbiased=True) if grouped.numel() > 1 else torch.zeros(())
    return (grouped - grouped.mean()) / (batch_std + eps)


# d_i = r_i - mean(r_group);  A_i = (d_i - mean(d_batch)) / (std(d_batch) + eps)   (REINFORCE++-baseline)
@advantage_estimator("reinforce++-baseline")
def group_centred_batch_whitened(grouped: torch.Tensor, eps: float) -> torch.Tensor:
    """[G, n] scores -> [G, n] advantages, each group centred, then normalised over the whole batch."""
    return batch_whitened(group_centred(grouped, eps), eps)


def group_advantages(scores: torch.Tensor, group_size: int, norm: str = "group", eps: float = 1e-6) -> torch.Tensor:
    """Scores [num_groups * group_size], group by group -> one advantage per sample, the same shape."""
    if scores.numel() % group_size:
        raise ValueError(f"{scores.numel()} rewards do not split into groups of {group_size}")
    if norm not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage normalisation {norm!r} (one of {', '.join(ADVANTAGE_ESTIMATORS)})")
    # Computed in float64: a std squares the scores, which float32 overflows from |score| ~ 1.8e19 (rewards
    # go to 1e30); the advantages themselves (at most 2e30 in magnitude) fit the float32 the loss uses.
    return ADVANTAGE_ESTIMATORS[norm](scores.double().view(-1, group_size), eps).view(-1).float()


def assign_advantages(samples: list[Sample], group_size: int, norm: str) -> dict:
    """Each sample's advantage from the scores (reward + shaping) of its group; their metrics."""
    if not samples:
        return {}
    advantages = group_advantages(torch.tensor([s.score for s in samples]), group_size, norm)
    for sample, advantage in zip(samples, advantages.tolist(), strict=True):
        sample.advantage = advantage
    return {"advantage_abs_mean": advantages.abs().mean().item()}
