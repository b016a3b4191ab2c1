"""Loading without ever holding the whole model: built on the meta device, sharded, and each rank
fills its shards from the rows of the safetensors files it owns."""

import pytest
import torch
from safetensors.torch import load_file

from rlsys.actors.inspectable_group import InspectableTrainerGroup
from rlsys.actors.loading import build_empty_model, fill_from_checkpoint, parameters_on_meta
from rlsys.tools.tiny_model import write_random_checkpoint
from tests.helpers import trainer_spec


def _write_model(out_dir, hidden=36, layers=2, vocab=101, tied=True, max_shard_size=None, dtype=torch.float32):
    """A Qwen2 with odd sizes (uneven shards over 2 ranks), tied embeddings, maybe several files."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=50, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=tied)
    model = Qwen2ForCausalLM(config).to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    return model


def test_parameters_are_built_on_meta_and_buffers_for_real():
    with parameters_on_meta():
        layer = torch.nn.Linear(3, 4)
    assert layer.weight.device.type == "meta" and layer.weight.requires_grad
    assert torch.nn.Module.register_parameter.__name__ == "register_parameter"  # restored


@pytest.mark.parametrize("max_shard_size", [None, "20KB"])
def test_an_unsharded_load_equals_from_pretrained_exactly(tmp_path, max_shard_size):
    from transformers import AutoModelForCausalLM

    _write_model(tmp_path, max_shard_size=max_shard_size)
    if max_shard_size:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    expected = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    model = build_empty_model(str(tmp_path), "sdpa")
    fill_from_checkpoint(model, tmp_path, "cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    for (name, tensor), (_, reference) in zip(model.state_dict().items(), expected.state_dict().items(), strict=True):
        assert torch.equal(tensor, reference), name
    for (name, buffer), (_, reference) in zip(model.named_buffers(), expected.named_buffers(), strict=True):
        assert torch.equal(buffer, reference), name  # rotary tables computed, not left empty


def test_a_checkpoint_that_does_not_match_the_config_is_named(tmp_path):
    from safetensors.torch import save_file

    _write_model(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    model = build_empty_model(str(tmp_path), "sdpa")
    with pytest.raises(KeyError, match=r"no tensor for parameter model.norm.weight"):
        fill_from_checkpoint(model, tmp_path, "cpu")


@pytest.mark.slow
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


@pytest.mark.slow
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
