"""Loading without ever holding the whole model: built on the meta device and filled from the
safetensors files, in this process. (Sharded over 2 ranks, each filling its shards from the rows of
the files it owns: tests/e2e/test_loading.py.)"""

import pytest
import torch
from safetensors.torch import load_file

from rlsys.actors.loading import build_empty_model, fill_from_checkpoint, parameters_on_meta


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
