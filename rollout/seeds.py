"""Every sample's own sampling seed, so that what it draws depends on the run's seed and where it
stands in the run, not on which engine served it, on its batch-mates or on what the engines drew
before: a resumed run, a run whose engine was restarted and a run with another number of engines
sample the tokens the uninterrupted run did (up to the engines' logits agreeing to the last bit).

A prompt drawn for training gets its seed from (run seed, data epoch, position in the epoch), the
position the data sampler restores on resume; an eval prompt from (run seed, eval set, prompt
number); sample k of a group from (prompt seed, k); a generate function's i-th engine call of a
trajectory from (sample seed, i). The engine draws each token from (seed, token position) alone
(SGLang's seeded Gumbel draw: rollout/sglang/cpu_compat/site/rlsys_seeded_sampling.py on CPUs).
"""

from __future__ import annotations

import hashlib

# SGLang's SamplingParams takes seeds in [-2**63, 2**63); rlsys's are in [0, 2**63).
_BITS = 63


def derived_seed(*key: int | str | None) -> int:
    """A seed in [0, 2**63) from `key` (ints and strings), the same in every process and release."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - _BITS)


def train_prompt_seed(run_seed: int, epoch: int, index: int) -> int:
    """The seed of the training prompt drawn at (epoch, index) of the data sampler."""
    return derived_seed("train", run_seed, epoch, index)


def eval_prompt_seed(run_seed: int, eval_set: str | None, number: int) -> int:
    """The seed of eval prompt `number` of `eval_set` (None: the data section's eval split)."""
    return derived_seed("eval", run_seed, eval_set, number)


def sample_seeds(prompt_seed: int | None, n: int) -> list[int | None]:
    """The seeds of a prompt's n samples (all None for a prompt without a seed: the engine draws)."""
    return [None if prompt_seed is None else derived_seed("sample", prompt_seed, k) for k in range(n)]


def call_seed(sample_seed: int | None, call: int) -> int | None:
    """The seed of a trajectory's `call`-th engine call (two calls on the same tokens then differ)."""
    return None if sample_seed is None else derived_seed("call", sample_seed, call)
