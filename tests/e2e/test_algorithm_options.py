"""Trainer-side algorithm options on a real FSDP trainer: masked tokens leave the loss, and
truncated importance sampling weighs each token's policy loss by its capped engine ratio."""

import math
from dataclasses import replace

import pytest
import torch

from rlsys.actors.inspectable_group import InspectableTrainerGroup
from rlsys.records import TrainSequence
from tests.helpers import random_sequences, trainer_spec

CAP = 1.5


def _batch(seed: int, count: int = 10) -> list[TrainSequence]:
    return random_sequences(seed, count, prompt_lens=(2, 6), response_lens=(2, 8))


@pytest.fixture(scope="module")
def groups(ray_cluster, tiny_model_dir):
    plain = InspectableTrainerGroup(trainer_spec(tiny_model_dir, lr=1e-3), 1)
    tis = InspectableTrainerGroup(
        trainer_spec(tiny_model_dir, lr=1e-3, corrections=[{"name": "importance_sampling", "max": CAP}]), 1)
    yield plain, tis
    plain.shutdown()
    tis.shutdown()


def _close(a: dict, b: dict) -> None:
    scale = max(g.abs().max().item() for g in b.values())
    assert scale > 1e-4  # a real gradient
    for name in a:
        assert torch.allclose(a[name], b[name], atol=1e-5 * scale, rtol=1e-5), name


def test_a_masked_sequence_contributes_nothing(groups):
    plain, _ = groups
    batch = _batch(0)
    masked = [replace(s) for s in batch]
    masked[4] = replace(masked[4], loss_mask=[0] * masked[4].response_len, advantage=5.0)
    without = batch[:4] + batch[5:]
    # token-mean: the masked tokens are not in the normaliser either
    _close(plain.loss_gradients(masked), plain.loss_gradients(without))


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


def test_truncation_options_and_tis_run_end_to_end_against_a_bf16_engine(tmp_path, tiny_model_dir, ray_address,
                                                                            bf16_engines):
    """Responses of up to 3 tokens from an untrained model nearly all run to max_new_tokens: the
    engine's finish reason masks them (mask_truncated) and the overlong penalty scores them. The
    engine runs in bf16 against the fp32 trainer, so its log-probs differ (a deliberately
    perturbed behaviour policy) and TIS weights are not all 1 (the session's bf16 standing set)."""
    import subprocess

    from rlsys.observability.metrics import read_metrics
    from tests.helpers import REPO, train_command

    run_dir = tmp_path / "run"
    result = subprocess.run(train_command(
        "quickstart.yaml", tiny_model_dir, run_dir, "trainer.total_steps=4", "rollout.max_new_tokens=3",
        "algorithm.mask_truncated=true", "algorithm.overlong_penalty={buffer_tokens: 1, factor: 0.5}",
        "algorithm.corrections=[importance_sampling]", "rollout.engine.extra_args=[--dtype, bfloat16]", ray_address,
        bf16_engines),
        capture_output=True, text=True, timeout=900, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    samples = 32 * 8
    for row in rows:
        assert row["truncated_fraction"] > 0.5
        # only responses that ended before max_new_tokens train: at most 3 tokens each
        assert row["train_tokens"] <= round((1 - row["truncated_fraction"]) * samples) * 3
        # a 3-token response loses 0.5; 2 tokens or fewer, nothing
        assert row["overlong_penalty_mean"] <= -0.5 * row["truncated_fraction"] + 1e-9
        assert row["logprob_mismatch"] > 1e-4  # bf16 engine; an fp32 one agrees to ~1e-7
        assert 0.9 < row["tis_weight_mean"] < 1.1 and row["tis_clipped_fraction"] < 0.5
    assert any(row["tis_weight_mean"] != 1.0 for row in rows)
