"""Stacked parameters (a mixture-of-experts layer's experts, transformers 5's layout) map onto the
per-expert tensors their checkpoints and SGLang's `load_weights` use: the trainer reads them
exactly as transformers does, and the weight sync hands an engine exactly the checkpoint's tensors."""

import pytest
import torch
from safetensors import safe_open

from rlsys.actors.checkpoint_layout import checkpoint_pieces, unsupported_layouts
from rlsys.actors.loading import build_empty_model, fill_from_checkpoint, parameters_without_tensor
from rlsys.tools.tiny_model import TinyModelSpec, make_tiny_model
from rlsys.weight_sync.buckets import as_checkpoint_tensors, gather_bucket


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("moe"), TinyModelSpec(arch="qwen3_moe", num_experts=4))


def _checkpoint(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 - not a dict


def test_each_stacked_expert_parameter_is_tiled_by_its_checkpoint_tensors_in_order(moe_dir):
    model = build_empty_model(str(moe_dir), "sdpa")
    pieces = checkpoint_pieces(model)
    assert sorted(pieces) == sorted(f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1)
                                    for p in ("gate_up_proj", "down_proj"))
    gate_up = pieces["model.layers.1.mlp.experts.gate_up_proj"]  # [E, 2I, H]: gate then up, expert by expert
    assert [p.name for p in gate_up[:3]] == ["model.layers.1.mlp.experts.0.gate_proj.weight",
                                             "model.layers.1.mlp.experts.0.up_proj.weight",
                                             "model.layers.1.mlp.experts.1.gate_proj.weight"]
    for name, tiles in pieces.items():
        assert sum(p.numel for p in tiles) == model.get_parameter(name).numel()
    assert unsupported_layouts(model) == [] and parameters_without_tensor(moe_dir) == []
    dense = build_empty_model(str(make_tiny_model(moe_dir.parent / "dense", TinyModelSpec(arch="qwen3"))), "sdpa")
    assert checkpoint_pieces(dense) == {}


def test_the_trainer_reads_a_moe_checkpoint_as_transformers_does(moe_dir):
    from transformers import AutoModelForCausalLM

    ours = build_empty_model(str(moe_dir), "sdpa")
    fill_from_checkpoint(ours, moe_dir, "cpu")
    theirs = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).state_dict()
    assert ours.state_dict().keys() == theirs.keys()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, theirs[name]), name


def test_the_sync_hands_the_engine_the_checkpoints_own_tensors_as_views(moe_dir):
    model = build_empty_model(str(moe_dir), "sdpa")
    fill_from_checkpoint(model, moe_dir, "cpu")
    pieces = {name: [(p.name, p.shape) for p in tiles] for name, tiles in checkpoint_pieces(model).items()}
    named = [(n, p) for n, p in model.named_parameters() if ".mlp." in n or "norm" in n]
    buffer = torch.empty(sum(p.numel() * 4 + 16 for _, p in named), dtype=torch.uint8)
    bucket = as_checkpoint_tensors(gather_bucket(named, buffer, alignment=16), pieces)
    sent = dict(bucket.tensors())
    stored = _checkpoint(moe_dir)
    expected = {n for n in stored if ".mlp." in n or "norm" in n}
    assert sent.keys() == expected  # every expert tensor by its checkpoint name, nothing stacked
    for name, tensor in sent.items():
        assert torch.equal(tensor, stored[name]), name
        assert tensor.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()  # a view, no copy
