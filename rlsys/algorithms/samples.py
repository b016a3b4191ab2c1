"""From engine generations to scored samples (`score_groups`, each round), and from a step's
scored samples to its training sequences (`prepare`, once per step)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from rlsys.algorithms.advantages import assign_advantages
from rlsys.algorithms.shaping import add_kl_penalty, add_overlong_penalty, loss_mask
from rlsys.config import AlgorithmConfig, OverlongPenaltyConfig
from rlsys.errors import RunFailed
from rlsys.records import Generation, PromptRecord, RewardCall, RewardOutcome, Sample, TrainSequence


@dataclass
class ScoredBatch:
    samples: list[Sample]  # complete groups whose rewards all computed (and, with dynamic sampling, informative)
    num_generations: int = 0  # every generation scored, kept or not
    reward_errors: int = 0
    first_error: str | None = None
    first_error_sample: dict[str, str] | None = None  # its prompt and response
    dropped_groups: int = 0  # groups with a failed reward call
    filtered_groups: int = 0  # groups whose scores were all equal, dropped by dynamic sampling
    sampling_rounds: int = 1
    task_rewards: list[float] = field(default_factory=list)  # of every scored group, filtered or not
    penalties: list[float] = field(default_factory=list)  # overlong penalties of the same samples
    parts: dict[str, list[float]] = field(default_factory=dict)  # a rubric's functions' values, of the same samples

    def merge(self, other: ScoredBatch) -> None:
        """Add another sampling round's groups and counts to this step's."""
        self.samples += other.samples
        self.num_generations += other.num_generations
        self.reward_errors += other.reward_errors
        if self.first_error is None:
            self.first_error, self.first_error_sample = other.first_error, other.first_error_sample
        self.dropped_groups += other.dropped_groups
        self.filtered_groups += other.filtered_groups
        self.task_rewards += other.task_rewards
        self.penalties += other.penalties
        for name, values in other.parts.items():
            self.parts.setdefault(name, []).extend(values)

    def reward_metrics(self) -> dict:
        """Task rewards of every sample scored this step (before dynamic sampling drops any), and
        what the reward function failed on; reward_mean and reward_std are None when none scored."""
        rewards = self.task_rewards
        # No sample scored (every group's reward failed): missing (null), never a 0.0 that looks measured.
        mean = sum(rewards) / len(rewards) if rewards else None
        metrics = {
            "reward_mean": mean,
            "reward_std": (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5 if rewards else None,
            "reward_errors": self.reward_errors,
            "dropped_groups": self.dropped_groups,
        }
        if self.penalties:
            metrics["overlong_penalty_mean"] = sum(self.penalties) / len(self.penalties)
        for name, values in sorted(self.parts.items()):
            metrics[f"rubric_{name}"] = sum(values) / len(values)
        return metrics


def response_text(tokenizer, response_ids: list[int], skip_special_tokens: bool = True) -> str:
    """Decode up to (not including) the first end-of-sequence token, without special tokens (as
    TRL, verl and slime give a reward function its completion) or, `skip_special_tokens` false,
    with them (a <pad> inside the answer stays in its text)."""
    eos = tokenizer.eos_token_id
    if eos in response_ids:
        response_ids = response_ids[: response_ids.index(eos)]
    return tokenizer.decode(response_ids, skip_special_tokens=skip_special_tokens)


def generation_text(tokenizer, generation: Generation, skip_special_tokens: bool = True) -> str:
    """What the reward reads (reward.skip_special_tokens): a single response up to its end-of-sequence
    token; a multi-turn trajectory whole with its special tokens (each turn may end with one)."""
    if generation.multi_turn:
        return tokenizer.decode(generation.response_ids, skip_special_tokens=False)
    return response_text(tokenizer, generation.response_ids, skip_special_tokens)


def reward_call(record: PromptRecord, generation: Generation, text: str) -> RewardCall:
    """The reward function's arguments; a trajectory's `info` joins the record's metadata."""
    metadata = {**record.metadata, **generation.info} if generation.info else record.metadata
    return RewardCall(record.prompt, text, record.label, metadata)


Scorer = Callable[[list[RewardCall]], list[RewardOutcome]]  # e.g. RewardPool.score


def score_groups(
    records: list[PromptRecord], generations: list[Generation], group_size: int, tokenizer, scorer: Scorer,
    overlong: OverlongPenaltyConfig | None = None, max_new_tokens: int = 0, skip_special_tokens: bool = True,
) -> ScoredBatch:
    """Reward every sample (plus DAPO's overlong penalty when configured); a group with any
    failing reward is dropped (and counted). `skip_special_tokens`: reward.skip_special_tokens."""
    texts = [generation_text(tokenizer, g, skip_special_tokens) for g in generations]
    calls = [reward_call(records[i // group_size], g, text)
             for i, (g, text) in enumerate(zip(generations, texts, strict=True))]
    outcomes = scorer(calls)
    batch = ScoredBatch(samples=[], num_generations=len(generations))
    for group_index, record in enumerate(records):
        group = range(group_index * group_size, (group_index + 1) * group_size)
        failed = [i for i in group if outcomes[i].error is not None]
        batch.reward_errors += len(failed)
        if failed:
            batch.dropped_groups += 1
            if batch.first_error is None:
                batch.first_error = outcomes[failed[0]].error
                batch.first_error_sample = {"prompt": record.prompt, "response": texts[failed[0]]}
            continue
        for i in group:
            sample = Sample(record, generations[i], texts[i], reward=outcomes[i].value)
            if overlong is not None:
                batch.penalties.append(add_overlong_penalty(sample, overlong, max_new_tokens))
            batch.samples.append(sample)
            batch.task_rewards.append(sample.reward)
            for name, value in (outcomes[i].parts or {}).items():
                batch.parts.setdefault(name, []).append(value)
    return batch


def check_reward_errors(scored: ScoredBatch, max_error_fraction: float, step: int) -> None:
    """Stop the run when more than `max_error_fraction` of a step's reward calls failed."""
    if scored.reward_errors > max_error_fraction * scored.num_generations:
        raise RunFailed(
            f"step {step}: {scored.reward_errors} of {scored.num_generations} rewards raised "
            f"(reward.max_error_fraction={max_error_fraction}); first error:\n{scored.first_error}"
        )


def to_train_sequences(samples: list[Sample], mask_truncated: bool = False) -> list[TrainSequence]:
    """Prompt + response token ids with their advantage. The loss counts the policy's tokens
    (a trajectory's injected tool output is masked) and, with `mask_truncated`, none of a
    truncated response's (algorithms/shaping.py `loss_mask`)."""
    return [
        TrainSequence(
            token_ids=s.generation.prompt_ids + s.generation.response_ids,
            prompt_len=len(s.generation.prompt_ids),
            advantage=s.advantage,
            engine_logprobs=s.generation.logprobs,
            loss_mask=loss_mask(s, mask_truncated),
            routes=s.generation.routes,
            images=s.record.images,
        )
        for s in samples
    ]


SequenceKL = Callable[[list[TrainSequence]], list[float]]  # e.g. TrainerGroup.compute_sequence_kl


def prepare(samples: list[Sample], algorithm: AlgorithmConfig, group_size: int,
            sequence_kl: SequenceKL | None = None) -> tuple[list[TrainSequence], dict]:
    """A step's scored samples -> its training sequences and their metrics, once per step: the
    sequences (with their loss masks), KL in reward (from `sequence_kl`, the summed KL estimate of
    each sequence's response tokens, when algorithm.kl_in_reward), then the advantages of the
    shaped scores. ([], {}) when no sequence has a token to train on (every group's reward failed,
    dynamic sampling found no informative group, or mask_truncated masked every response): the
    caller skips the optimizer step, since Adam would still move the weights on a zero gradient."""
    sequences = to_train_sequences(samples, algorithm.mask_truncated)
    if not any(seq.loss_tokens for seq in sequences):
        return [], {}
    metrics = {}
    if algorithm.kl_in_reward:
        # KL is summed over every response token, whatever the loss mask (it only reads the ids).
        metrics.update(add_kl_penalty(samples, sequence_kl(sequences), algorithm.kl_coef))
    metrics.update(assign_advantages(samples, group_size, algorithm.advantage_estimator))
    for seq, sample in zip(sequences, samples, strict=True):
        seq.advantage = sample.advantage
    return sequences, metrics


def truncated_fraction(generations: list[Generation]) -> float:
    return sum(g.finish_reason == "length" for g in generations) / max(len(generations), 1)
