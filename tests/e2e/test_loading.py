"""Loading without ever holding the whole model, on 2 trainer ranks: sharded, and each rank fills its
shards from the rows of the safetensors files it owns. (Built on the meta device and filled in one
process: tests/unit/test_loading.py.)"""

import pytest
import torch
from safetensors.torch import load_file

from rlsys.actors.inspectable_group import InspectableTrainerGroup
from rlsys.tools.tiny_model import write_random_checkpoint
from tests.helpers import trainer_spec
from tests.unit.test_loading import _write_model

pytestmark = pytest.mark.second_stream  # trainer ranks, no engine set: on the second stream's cluster (Makefile: test)


def test_two_ranks_hold_exactly_the_checkpoint_between_them(ray_cluster, tmp_path):
    _write_model(tmp_path, max_shard_size="20KB")
    group = InspectableTrainerGroup(trainer_spec(tmp_path), num_ranks=2)
    try:
        full = group.full_state_dict()
    finally:
        group.shutdown()
    stored = {}
    for file in tmp_path.glob("*.safetensors"):
        stored.update(load_file(file))
    assert set(full) == set(stored) - {"lm_head.weight"}  # tied: one parameter
    for name, tensor in full.items():
        assert torch.equal(tensor, stored[name]), name


def test_a_rank_load_peaks_near_its_shard_not_the_model(ray_cluster, tmp_path):
    """2 ranks, a ~0.5B-parameter model (Qwen2.5-0.5B's shape, bf16 files): each rank's resident
    memory rises during the load by at most 0.75x the model's fp32 bytes (its half, plus a slice)."""
    model_bytes = write_random_checkpoint(tmp_path, "qwen2.5-0.5b")
    group = InspectableTrainerGroup(trainer_spec(tmp_path), num_ranks=2)
    try:
        reports = group.load_memory_reports()
    finally:
        group.shutdown()
    for report in reports:
        assert report["model_bytes"] == model_bytes
        assert report["peak_rss_bytes"] - report["rss_before_bytes"] <= 0.75 * model_bytes, reports
