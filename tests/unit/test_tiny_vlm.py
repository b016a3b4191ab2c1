"""`rlsys make-tiny-model --arch qwen2_5_vl`: a Qwen2.5-VL and its processor that transformers'
Auto classes load offline, in the released checkpoints' layout, with the shapes SGLang's CPU path
reads the same way (rlsys/tools/tiny_vlm.py)."""

import json

import pytest

from rlsys.errors import UsageError
from rlsys.tools.tiny_model import TinyModelSpec, make_tiny_model
from rlsys.tools.tiny_vlm import IMAGE_PLACEHOLDER, IMAGE_TOKENS_MAX, PATCH_SIZE, TEMPORAL_PATCH_SIZE


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("vlm"), TinyModelSpec(arch="qwen2_5_vl"))


def test_the_processor_and_model_load_offline_and_an_image_becomes_its_merged_patches(vlm_dir):
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(vlm_dir)
    model = AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32)
    config = json.loads((vlm_dir / "config.json").read_text())
    tokenizer = processor.tokenizer
    assert config["image_token_id"] == tokenizer.convert_tokens_to_ids("<|image_pad|>") == processor.image_token_id
    assert config["vision_start_token_id"] == tokenizer.convert_tokens_to_ids("<|vision_start|>")
    assert config["text_config"]["vocab_size"] == len(tokenizer)  # no id the model could sample decodes to nothing

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "red?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert IMAGE_PLACEHOLDER + "red?" in text
    inputs = processor(text=[text], images=[Image.new("RGB", (100, 60), (255, 0, 0))], return_tensors="pt")
    # the image resized into [28 x 28, 56 x 56] pixels: a grid of h x w patches, merged 2 x 2 into tokens
    (t, h, w), = inputs["image_grid_thw"].tolist()
    assert t == 1 and inputs["pixel_values"].shape == (h * w, 3 * TEMPORAL_PATCH_SIZE * PATCH_SIZE ** 2)
    image_tokens = int((inputs["input_ids"] == processor.image_token_id).sum())
    assert image_tokens == h * w // 4 and 1 <= image_tokens <= IMAGE_TOKENS_MAX
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], len(tokenizer)) and torch.isfinite(logits).all()


def test_the_checkpoint_is_in_the_released_layout(vlm_dir):
    """Hub checkpoints (and SGLang's loader) name the language model `model.*` and the tower `visual.*`;
    transformers 5 renames them to model.language_model.* / model.visual.* on loading."""
    from safetensors import safe_open

    with safe_open(vlm_dir / "model.safetensors", "pt") as weights:
        roots = {".".join(name.split(".")[:2]) for name in weights.keys()}
    assert roots == {"lm_head.weight", "model.embed_tokens", "model.layers", "model.norm", "visual.blocks",
                     "visual.merger", "visual.patch_embed"}


def test_shapes_the_multimodal_rope_or_the_cpu_padding_would_change_are_refused():
    with pytest.raises(UsageError, match="head size .* divisible by 8"):
        TinyModelSpec(arch="qwen2_5_vl", hidden_size=48, num_heads=4)
    with pytest.raises(UsageError, match="intermediate-size divisible by 32"):
        TinyModelSpec(arch="qwen2_5_vl", intermediate_size=100)


def test_the_trainer_builds_the_vlm_and_reads_every_weight_under_its_released_name(vlm_dir, tmp_path):
    """actors/loading.py: the vision-language class on the meta device, filled from the checkpoint's
    `model.*`/`visual.*` tensors into transformers 5's `model.language_model.*`/`model.visual.*`
    parameters: what transformers' own from_pretrained loads; a missing tower tensor is named."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForImageTextToText

    from rlsys.actors.loading import build_empty_model, fill_from_checkpoint, parameters_without_tensor

    model = build_empty_model(str(vlm_dir), "sdpa")
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    fill_from_checkpoint(model, vlm_dir, "cpu")
    expected = AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32).state_dict()
    loaded = model.state_dict()
    assert loaded.keys() == expected.keys() and any(name.startswith("model.visual.") for name in loaded)
    assert all(torch.equal(loaded[name], expected[name]) for name in expected)
    assert parameters_without_tensor(vlm_dir) == []

    damaged = shutil.copytree(vlm_dir, tmp_path / "damaged")
    tensors = load_file(damaged / "model.safetensors")
    del tensors["visual.blocks.0.attn.qkv.weight"]
    save_file(tensors, damaged / "model.safetensors", metadata={"format": "pt"})
    assert parameters_without_tensor(damaged) == ["visual.blocks.0.attn.qkv.weight"]
