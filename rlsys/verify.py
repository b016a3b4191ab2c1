"""Check after a sync that every engine holds the trainer's weights.

We compare log-probabilities of fixed probe sequences instead of per-tensor checksums: SGLang
fuses and shards tensors differently from the trainer (qkv_proj, gate_up_proj, TP shards), so a
checksum would need engine-specific name and layout mapping, while a logprob probe tests exactly
what matters (the engine computes the trainer's distribution) through every parameter at once.
A stale or partly loaded tensor moves the probes far beyond the fp32 tolerance (see tests).
"""

from __future__ import annotations

import random

from rlsys.actors.batching import TrainSequence


class WeightSyncMismatch(RuntimeError):
    """An engine does not compute what the trainer computes after a weight sync."""


def probe_sequences(vocab_size: int, seed: int, count: int = 4, length: int = 24) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(count)]


def verify_engine_weights(trainer, rollout, weight_version: int, tolerance: float, seed: int) -> float:
    """Returns the largest |engine - trainer| probe log-prob; raises WeightSyncMismatch above `tolerance`."""
    versions = rollout.weight_versions()
    stale = [i for i, version in enumerate(versions) if version != weight_version]
    if stale:
        raise WeightSyncMismatch(f"engine(s) {stale} report weight versions {versions}, expected {weight_version}")
    probes = probe_sequences(trainer.vocab_size(), seed)
    expected = trainer.compute_log_probs([TrainSequence(p, prompt_len=1) for p in probes])
    worst = 0.0
    for index in range(len(rollout.engines)):
        got = rollout.score(probes, engine_index=index)
        diff = max(abs(a - b) for row_a, row_b in zip(got, expected, strict=True) for a, b in zip(row_a, row_b, strict=True))
        if diff > tolerance:
            raise WeightSyncMismatch(
                f"engine {index} ({rollout.addresses[index].url}) disagrees with the trainer after syncing weight version "
                f"{weight_version}: max |logprob diff| {diff:.3g} > {tolerance:.3g}"
            )
        worst = max(worst, diff)
    return worst
