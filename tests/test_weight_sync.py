"""Colocated weight sync into a real SGLang server: the engine ends up computing what the trainer does."""

import random

import pytest

from actors.batching import TrainSequence
from actors.group import TrainerGroup
from actors.trainer import TrainerSpec
from rollout.engine import SamplingParams
from rollout.manager import RolloutManager
from rollout.server import ServerSpec

FIXED = [[5, 9, 14, 3, 7, 7, 20, 31], [40, 41, 42, 6, 6, 6], [12, 65, 13, 65, 14, 73, 15, 1]]


def _batch(seed: int) -> list[TrainSequence]:
    rng = random.Random(seed)
    return [
        TrainSequence([rng.randrange(3, 80) for _ in range(8)], prompt_len=4, advantage=rng.choice([-1.0, 1.0]))
        for _ in range(16)
    ]


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for row_a, row_b in zip(a, b, strict=True) for x, y in zip(row_a, row_b, strict=True))


@pytest.fixture(scope="module")
def engine_and_trainer(ray_cluster, tiny_model_dir, tmp_path_factory):
    spec = ServerSpec(model_path=str(tiny_model_dir), skip_tokenizer_init=True, context_length=64,
                      max_total_tokens=4096)
    rollout = RolloutManager(spec, 1, str(tmp_path_factory.mktemp("logs")), [{"num_cpus": 1}],
                             startup_timeout_s=300, request_timeout_s=120)
    trainer = TrainerGroup(TrainerSpec(model_path=str(tiny_model_dir), lr=1e-2), num_ranks=2)
    rollout.wait_ready()
    yield rollout, trainer
    rollout.shutdown()
    trainer.shutdown()


@pytest.mark.slow
def test_engine_logprobs_equal_trainer_logprobs_after_sync(engine_and_trainer):
    rollout, trainer = engine_and_trainer
    fixed = [TrainSequence(tokens, prompt_len=1) for tokens in FIXED]
    assert _max_diff(rollout.score(FIXED), trainer.compute_log_probs(fixed)) < 1e-3  # same start
    assert rollout.weight_versions() == [0]

    trainer.train_step(_batch(0))
    trainer_logprobs = trainer.compute_log_probs(fixed)
    assert _max_diff(rollout.score(FIXED), trainer_logprobs) > 1e-2  # engine still has old weights

    trainer.sync_weights(rollout.urls, rollout.tp_size, 16 * 2**20, weight_version=1)
    assert _max_diff(rollout.score(FIXED), trainer_logprobs) < 1e-3
    assert rollout.weight_versions() == [1]
    generation = rollout.generate([FIXED[0][:3]], SamplingParams(max_new_tokens=2), n=2)
    assert [g.weight_version for g in generation] == [1, 1]


@pytest.mark.slow
def test_bucket_smaller_than_largest_tensor_still_syncs(engine_and_trainer):
    rollout, trainer = engine_and_trainer
    fixed = [TrainSequence(tokens, prompt_len=1) for tokens in FIXED]
    trainer.train_step(_batch(1))
    stats = trainer.sync_weights(rollout.urls, rollout.tp_size, 4096, weight_version=2)
    assert stats[0]["buckets"] > 20  # every tensor (the largest is 64 KB) travelled on its own
    assert _max_diff(rollout.score(FIXED), trainer.compute_log_probs(fixed)) < 1e-3
    assert rollout.weight_versions() == [2]
