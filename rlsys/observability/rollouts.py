"""Every trained sample of every step, saved as the trainer got it (logging.save_rollouts): what
slime's --save-debug-rollout-data and verl's rollout_data_dir keep, for reading a run's batches
back, or replaying them through another trainer's update (bench/replay.py).

RUN_DIR/rollouts/step_NNNNNN.jsonl, one line per sample, in the step's order (groups of
rollout.n_samples_per_prompt answers to one prompt, one after another):

    prompt, label, response      the texts (response: what the reward read)
    prompt_ids, response_ids     token ids (response_ids as the engine returned them, a stop token included)
    engine_logprobs              the engine's log-prob of each response token
    loss_mask                    per response token, 1 where the loss counts it; null: every token
    reward, score, advantage     the task's reward, with the algorithm's shaping, and the advantage trained on
    finish_reason, weight_version
    info                         what a generate function or an environment attached to the sample (an
                                 OpenEnv episode's reset and steps); only when there is any

A step's file is written whole (a temporary file renamed), so a resumed run that runs a step again
replaces it rather than adding to it.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlsys.records import Sample, TrainSequence

ROLLOUTS_DIR = "rollouts"


def rollout_file(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / ROLLOUTS_DIR / f"step_{step:06d}.jsonl"


def rollout_rows(samples: list[Sample], sequences: list[TrainSequence]) -> list[dict]:
    """One row per sample with the sequence the trainer got for it (same order, same length)."""
    return [
        {
            **({"info": sample.generation.info} if sample.generation.info else {}),
            "prompt": sample.record.prompt, "label": sample.record.label, "response": sample.response_text,
            "prompt_ids": sample.generation.prompt_ids, "response_ids": sample.generation.response_ids,
            "engine_logprobs": sample.generation.logprobs, "loss_mask": sequence.loss_mask,
            "reward": sample.reward, "score": sample.score, "advantage": sequence.advantage,
            "finish_reason": sample.generation.finish_reason, "weight_version": sample.generation.weight_version,
        }
        for sample, sequence in zip(samples, sequences, strict=True)
    ]


class RolloutDump:
    """Writes each step's rows when `enabled` (logging.save_rollouts), else does nothing."""

    def __init__(self, run_dir: Path, enabled: bool):
        self.run_dir, self.enabled = Path(run_dir), enabled

    def save(self, step: int, samples: list[Sample], sequences: list[TrainSequence]) -> None:
        if not self.enabled:
            return
        path = rollout_file(self.run_dir, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(".jsonl.tmp")
        temporary.write_text("".join(json.dumps(row) + "\n" for row in rollout_rows(samples, sequences)))
        temporary.replace(path)


def read_rollouts(directory: Path) -> list[list[dict]]:
    """Every step's rows from a rollouts directory, in step order (bench/replay.py reads them)."""
    files = sorted(Path(directory).glob("step_*.jsonl"))
    if not files:
        raise FileNotFoundError(f"no step_*.jsonl in {directory} (a run saves them with logging.save_rollouts: true)")
    return [[json.loads(line) for line in path.read_text().splitlines() if line.strip()] for path in files]
