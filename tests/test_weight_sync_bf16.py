"""bf16 on the wire: fp32 master weights reach a bf16 engine as bf16 buckets. Its own module: it
starts its own engine and trainer ranks, which must not share the Ray cluster with
test_weight_sync.py's module-wide engines (the cluster has room for one set at a time)."""

import pytest

from rlsys.actors.group import TrainerGroup
from rlsys.config import EngineConfig, ModelConfig
from rlsys.rollout.manager import RolloutManager
from rlsys.rollout.server import ServerSpec
from tests.conftest import trainer_spec
from tests.test_weight_sync import _batch, _engines_match_trainer, _topology


@pytest.mark.slow
def test_a_bf16_engine_receives_bf16_buckets_and_matches_the_trainer(ray_cluster, tiny_model_dir, tmp_path):
    """fp32 master weights are cast shard by shard while gathering: half the bytes travel, and the
    engine then computes what the trainer computes, within bf16's resolution, on both transports."""
    engine = EngineConfig(skip_tokenizer_init=True, context_length=64, max_total_tokens=4096, request_timeout_s=120)
    rollout = RolloutManager(ServerSpec(ModelConfig(path=str(tiny_model_dir), dtype="bfloat16"), engine), 1,
                             str(tmp_path), [{"num_cpus": 1}])
    trainer = TrainerGroup(trainer_spec(tiny_model_dir, dtype="bfloat16", lr=1e-2), num_ranks=2)
    try:
        rollout.wait_ready()
        fp32_bytes = sum(t.numel() * 4 for t in trainer.full_state_dict().values())
        for version, mode in [(1, "colocated"), (2, "disaggregated")]:
            trainer.train_step(_batch(version))
            assert min(_engines_match_trainer(rollout, trainer)) > 5e-2  # the engine holds older weights
            trainer.connect_engines(_topology(mode, rollout.addresses), timeout_s=60)
            stats = trainer.sync_weights(16 * 2**20, weight_version=version)
            assert stats[0]["bytes"] <= fp32_bytes // 2 + 64 * stats[0]["buckets"]  # bf16 on the wire
            assert max(_engines_match_trainer(rollout, trainer)) < 5e-2  # weight_sync.verify's bf16 tolerance
            assert rollout.weight_versions() == [version]
    finally:
        rollout.shutdown()
        trainer.shutdown()
