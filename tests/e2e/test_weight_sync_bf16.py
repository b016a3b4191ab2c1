"""bf16 on the wire: fp32 master weights reach a bf16 engine as bf16 buckets, and the probe check
tells a bf16 engine's rounding from a stale or missing tensor. The engine is the session's bf16
standing set (tests/conftest.py `bf16_engines`), reset to the model's weights for each test."""

import pytest
import ray
import torch

from rlsys.actors.inspectable_group import InspectableTrainerGroup
from rlsys.records import TrainSequence
from rlsys.run.verify import (
    WeightSyncMismatch,
    compare_logprobs,
    model_depth,
    probe_sequences,
    rounding_tolerance,
    verify_engine_weights,
)
from tests.e2e.test_weight_sync import _batch, _engines_match_trainer, _topology
from tests.helpers import standing_rollout, trainer_spec


def test_a_bf16_engine_receives_bf16_buckets_and_matches_the_trainer(bf16_engines, tiny_model_dir, tmp_path):
    """fp32 master weights are cast shard by shard while gathering: half the bytes travel, and the
    engine then computes what the trainer computes, within bf16's resolution, on both transports."""
    trainer = InspectableTrainerGroup(trainer_spec(tiny_model_dir, dtype="bfloat16", lr=1e-2), num_ranks=2)
    try:
        with standing_rollout("bf16", tmp_path) as rollout:
            fp32_bytes = sum(t.numel() * 4 for t in trainer.full_state_dict().values())
            for version, mode in [(1, "colocated"), (2, "disaggregated")]:
                trainer.train_step(_batch(version))
                assert min(_engines_match_trainer(rollout, trainer)) > 5e-2  # the engine holds older weights
                trainer.connect_engines(_topology(mode, rollout.fleet.addresses), timeout_s=60)
                stats = trainer.sync_weights(16 * 2**20, weight_version=version)
                assert stats[0]["bytes"] <= fp32_bytes // 2 + 64 * stats[0]["buckets"]  # bf16 on the wire
                assert max(_engines_match_trainer(rollout, trainer)) < 5e-2  # bf16 rounding of this 2-layer model
                assert rollout.fleet.weight_versions() == [version]
    finally:
        trainer.shutdown()


def _swap_trainer_tensor(trainer, name: str, value):
    """Replace one parameter on the (single) trainer rank in place; returns what it held."""
    def swap(worker, name, value):
        param = dict(worker.model.named_parameters())[name]
        held = param.detach().clone()
        param.data.copy_(value)
        return held

    return ray.get(trainer.workers[0].__ray_call__.remote(swap, name, value))


def test_verify_passes_a_bf16_engine_and_names_a_stale_or_missing_tensor(bf16_engines, tiny_model_dir, tmp_path):
    """A bf16 engine against an fp32 trainer: a correct sync passes the probe check (bf16 rounding
    stays under the derived bound), while one stale or one missing tensor on the engine fails it."""
    trainer = InspectableTrainerGroup(trainer_spec(tiny_model_dir, dtype="float32", lr=1e-2), num_ranks=1)
    check = {"tolerance": None, "seed": 0, "dtype": "bfloat16", "num_layers": model_depth(str(tiny_model_dir))}

    def sync_with(version: int, name: str | None = None, value=None):
        """Sync `version`, with `name` holding `value` on the engine instead of the trainer's tensor."""
        trainer.train_step(_batch(version))
        held = _swap_trainer_tensor(trainer, name, value) if name else None
        trainer.sync_weights(16 * 2**20, weight_version=version)
        if name:
            _swap_trainer_tensor(trainer, name, held)

    try:
        with standing_rollout("bf16", tmp_path) as rollout:
            trainer.connect_engines(_topology("colocated", rollout.fleet.addresses, num_ranks=1), timeout_s=60)
            sync_with(1)
            good = verify_engine_weights(trainer, rollout.fleet, 1, **check)
            bound = rounding_tolerance("bfloat16", check["num_layers"], _mean_abs_probe_logprob(trainer))
            assert good < bound / 4  # bf16 rounding sits far below what the bound allows

            stale = trainer.full_state_dict()["lm_head.weight"]  # version 1's
            sync_with(2, "lm_head.weight", stale)
            with pytest.raises(WeightSyncMismatch, match=r"engine 0 .* weight version 2: mean \|logprob diff\|"):
                verify_engine_weights(trainer, rollout.fleet, 2, **check)

            missing = torch.zeros_like(trainer.full_state_dict()["model.layers.1.self_attn.o_proj.weight"])
            sync_with(3, "model.layers.1.self_attn.o_proj.weight", missing)
            with pytest.raises(WeightSyncMismatch, match="missing, stale, transposed or cast wrong"):
                verify_engine_weights(trainer, rollout.fleet, 3, **check)

            sync_with(4)  # a whole sync repairs the engine
            assert verify_engine_weights(trainer, rollout.fleet, 4, **check) < bound / 4
    finally:
        trainer.shutdown()


def _mean_abs_probe_logprob(trainer) -> float:
    probes = probe_sequences(trainer.vocab_size(), seed=0)
    logprobs = trainer.compute_log_probs([TrainSequence(p, prompt_len=1) for p in probes])
    return compare_logprobs(logprobs, logprobs).mean_abs_logprob
