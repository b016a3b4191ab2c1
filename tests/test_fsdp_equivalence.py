"""2 FSDP2 ranks train exactly like one unsharded process (fp32)."""

import random

import pytest
import torch

from actors.batching import TrainSequence
from actors.group import TrainerGroup
from actors.trainer import TrainerSpec


def _sequences(seed: int, count: int, vocab: int) -> list[TrainSequence]:
    rng = random.Random(seed)
    sequences = []
    for _ in range(count):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 6))]
        response = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 5))]
        sequences.append(TrainSequence(prompt + response, len(prompt), advantage=rng.uniform(-1.5, 1.5)))
    return sequences


@pytest.mark.slow
def test_two_fsdp_ranks_match_one_unsharded_process(ray_cluster, tiny_model_dir):
    # Several micro-batches per rank, two optimizer steps per batch (so clipping acts), KL on.
    spec = TrainerSpec(
        model_path=str(tiny_model_dir), lr=1e-3, micro_batch_size=3, mini_batches_per_step=2,
        use_kl_loss=True, kl_coef=0.1, entropy_coef=0.01, clip_eps_low=0.01, clip_eps_high=0.01, seed=0,
    )
    sharded = TrainerGroup(spec, num_ranks=2)
    single = TrainerGroup(TrainerSpec(**{**spec.__dict__, "shard": False}), num_ranks=1)
    try:
        for step in range(4):
            batch = _sequences(step, count=13, vocab=80)
            a, b = sharded.train_step(batch), single.train_step(batch)
            assert a["loss"] == pytest.approx(b["loss"], abs=1e-5), f"step {step}"
            assert a["kl"] == pytest.approx(b["kl"], abs=1e-5)
        assert a["kl"] > 0 and a["clip_fraction"] > 0  # the policy moved, so both terms were exercised
        params_a, params_b = sharded.full_state_dict(), single.full_state_dict()
        assert params_a.keys() == params_b.keys()
        worst = max((params_a[k] - params_b[k]).abs().max().item() for k in params_a)
        assert worst < 1e-5, f"max parameter difference {worst}"
        moved = max((params_a[k] - initial).abs().max().item()
                    for k, initial in _initial_params(tiny_model_dir).items())
        assert moved > 1e-3  # training really changed the weights
    finally:
        sharded.shutdown()
        single.shutdown()


def _initial_params(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return {name: p.detach() for name, p in model.named_parameters()}
