"""The weight check's decisions (rlsys/run/verify.py) with stand-in trainer and engines: at which
temperature each side scores the probes, and which dtype's rounding bounds their agreement.

The stand-ins share one bigram "model" (the log-probs of token t after token s are a fixed table's
row s): the trainer computes them at a temperature, as TrainerWorker does, the engine as SGLang's
prefill scoring does, at temperature 1 whatever the request asks (rollout/engine.py: SCORE_TEMPERATURE).
The real pair is checked in tests/e2e/test_weight_sync.py and test_weight_sync_bf16.py.
"""

import math
import random

import pytest

from rlsys.config import ModelConfig
from rlsys.rollout.engine import SCORE_TEMPERATURE
from rlsys.rollout.sglang.server import ServerSpec
from rlsys.run.verify import FP32_TOLERANCE, WeightSyncMismatch, rounding_tolerance, verify_engine_weights

VOCAB = 50


def _logits() -> list[list[float]]:
    rng = random.Random(0)
    return [[rng.gauss(0.0, 3.0) for _ in range(VOCAB)] for _ in range(VOCAB)]


def _logprob(logits: list[float], token: int, temperature: float) -> float:
    scaled = [z / temperature for z in logits]
    top = max(scaled)
    return scaled[token] - top - math.log(sum(math.exp(z - top) for z in scaled))


class _Trainer:
    """Log-probs of each sequence's tokens after the first, at the rollout's temperature unless told."""

    def __init__(self, rollout_temperature: float):
        self.rollout_temperature = rollout_temperature
        self.logits = _logits()
        self.temperatures = []

    def vocab_size(self) -> int:
        return VOCAB

    def compute_log_probs(self, sequences, reference=False, temperature=None):
        temperature = self.rollout_temperature if temperature is None else temperature
        self.temperatures.append(temperature)
        return [[_logprob(self.logits[s.token_ids[i - 1]], s.token_ids[i], temperature)
                 for i in range(s.prompt_len, len(s.token_ids))] for s in sequences]


class _Rollout:
    """One engine: SGLang's prefill log-probs (temperature 1), optionally off by `error` (rounding)."""

    def __init__(self, has_gpu: bool = False, dtype: str = "float32", error: float = 0.0):
        self.spec = ServerSpec(ModelConfig(path="unused", dtype=dtype), has_gpu=has_gpu)
        self.engines = [object()]
        self.addresses = [type("Address", (), {"url": "http://engine-0"})()]
        self.logits = _logits()
        self.error = error

    def weight_versions(self) -> list[int]:
        return [1]

    def score(self, sequences, engine_index=0):
        return [[_logprob(self.logits[s[i - 1]], s[i], SCORE_TEMPERATURE) + self.error for i in range(1, len(s))]
                for s in sequences]


@pytest.mark.parametrize("rollout_temperature", [1.0, 0.7, 1.3])
def test_trainer_and_engine_score_the_probes_at_the_same_temperature(rollout_temperature):
    trainer = _Trainer(rollout_temperature)
    assert verify_engine_weights(trainer, _Rollout(), 1, None, seed=0) < 1e-9
    assert trainer.temperatures == [SCORE_TEMPERATURE]


def test_an_fp32_run_on_gpus_is_bounded_by_bf16_rounding_its_engines_serve():
    """model.dtype float32 on a GPU: the engine serves bf16 (rlsys/system/backend.py: engine_dtype), so
    bf16 rounding is no mismatch there, while on CPU (an fp32 engine) the same difference is."""
    layers = 4
    bf16_bound = rounding_tolerance("bfloat16", layers, mean_abs_logprob=2.0)
    error = (FP32_TOLERANCE + bf16_bound) / 2  # above fp32's bound, below bf16's for |log p| >= 2
    assert FP32_TOLERANCE < error < bf16_bound
    gpu = _Rollout(has_gpu=True, dtype="float32", error=error)
    assert verify_engine_weights(_Trainer(1.0), gpu, 1, None, seed=0, dtype="float32", num_layers=layers) == \
        pytest.approx(error)
    cpu = _Rollout(has_gpu=False, dtype="float32", error=error)
    with pytest.raises(WeightSyncMismatch, match="more than float32 rounding"):
        verify_engine_weights(_Trainer(1.0), cpu, 1, None, seed=0, dtype="float32", num_layers=layers)
