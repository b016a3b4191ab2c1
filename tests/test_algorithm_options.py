"""Trainer-side algorithm options on a real FSDP trainer: masked tokens leave the loss, and
truncated importance sampling weighs each token's policy loss by its capped engine ratio."""

import math
import random
from dataclasses import replace

import pytest
import torch

from rlsys.actors.batching import TrainSequence
from rlsys.actors.group import TrainerGroup
from tests.conftest import trainer_spec

CAP = 1.5


def _batch(seed: int, count: int = 10) -> list[TrainSequence]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        prompt = [rng.randrange(3, 80) for _ in range(rng.randint(2, 6))]
        response = [rng.randrange(3, 80) for _ in range(rng.randint(2, 8))]
        out.append(TrainSequence(prompt + response, len(prompt), advantage=rng.uniform(-1.5, 1.5)))
    return out


@pytest.fixture(scope="module")
def groups(ray_cluster, tiny_model_dir):
    plain = TrainerGroup(trainer_spec(tiny_model_dir, lr=1e-3), 1)
    tis = TrainerGroup(trainer_spec(tiny_model_dir, lr=1e-3, tis={"enabled": True, "cap": CAP}), 1)
    yield plain, tis
    plain.shutdown()
    tis.shutdown()


def _close(a: dict, b: dict) -> None:
    scale = max(g.abs().max().item() for g in b.values())
    assert scale > 1e-4  # a real gradient
    for name in a:
        assert torch.allclose(a[name], b[name], atol=1e-5 * scale, rtol=1e-5), name


@pytest.mark.slow
def test_a_masked_sequence_contributes_nothing(groups):
    plain, _ = groups
    batch = _batch(0)
    masked = [replace(s) for s in batch]
    masked[4] = replace(masked[4], loss_mask=[0] * masked[4].response_len, advantage=5.0)
    without = batch[:4] + batch[5:]
    # token-mean: the masked tokens are not in the normaliser either
    _close(plain.loss_gradients(masked), plain.loss_gradients(without))


@pytest.mark.slow
def test_tis_weights_each_sequence_by_its_capped_engine_ratio(groups):
    """A deliberately perturbed engine: its log-probs are the trainer's minus delta_i for every
    token of sequence i, so rho = exp(delta_i). With one mini-batch the PPO ratio is 1 and the
    policy gradient of token t is -A_i * min(rho, cap) * grad log p_t: the same as the plain
    loss with advantages A_i * min(exp(delta_i), cap)."""
    plain, tis = groups
    batch = _batch(1)
    trainer_logprobs = plain.compute_log_probs(batch)
    deltas = [0.4, -0.3, 0.9, 0.0, -1.2, 0.2, 0.6, -0.1, 1.5, 0.3]
    perturbed = [replace(s, engine_logprobs=[lp - d for lp in logprobs])
                 for s, logprobs, d in zip(batch, trainer_logprobs, deltas, strict=True)]
    weights = [min(math.exp(d), CAP) for d in deltas]
    scaled = [replace(s, advantage=s.advantage * w) for s, w in zip(batch, weights, strict=True)]
    _close(tis.loss_gradients(perturbed), plain.loss_gradients(scaled))

    metrics = tis.train_step(perturbed)
    tokens = [s.response_len for s in batch]
    expected_mean = sum(w * n for w, n in zip(weights, tokens, strict=True)) / sum(tokens)
    expected_clipped = sum(n for d, n in zip(deltas, tokens, strict=True) if math.exp(d) > CAP) / sum(tokens)
    assert metrics["tis_weight_mean"] == pytest.approx(expected_mean, rel=1e-4)
    assert metrics["tis_clipped_fraction"] == pytest.approx(expected_clipped)
    assert "tis_weight_mean" not in plain.train_step(batch)
