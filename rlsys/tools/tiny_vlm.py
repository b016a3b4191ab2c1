"""A tiny random-init Qwen2.5-VL (a vision tower of 2 blocks on a small patch grid, a 2-layer
language model) with a processor that loads offline: `rlsys make-tiny-model --arch qwen2_5_vl`; and
its Qwen3-VL twin (`--arch qwen3_vl`: a Qwen3 language model with interleaved 3-row RoPE, a vision
tower of 16-pixel patches with learned position embeddings, and one deepstack merger feeding the
first decoder layer), built from the same tokenizer and chat template.

The shapes keep to what both sides of a VLM run read the same way (sglang 0.5.23's
models/qwen2_5_vl.py and transformers 5's modeling_qwen2_5_vl.py):
- patches of 14 x 14 pixels x 2 frames x 3 channels (1,176 values): SGLang takes pixel values of any
  other width as image embeddings already made, and passes them on unencoded;
- intermediate sizes that are multiples of 32 (SGLang pads them to that on the CPU, which would change
  the weights' shapes) and a vision head size divisible by 4 (its rotary embedding halves it twice);
- the text model's `mrope_section` (temporal, height, width) adding up to half its head size, which is
  what turns on SGLang's 3-row multimodal RoPE;
- the image, video and vision start/end token ids of this tokenizer (the defaults are Qwen's ~151k).

The processor sizes an image to between 28 x 28 and 56 x 56 pixels: at most a 4 x 4 patch grid,
merged 2 x 2 into 4 image tokens (`IMAGE_TOKENS_MAX`), so an image costs little of a 64-token context.
"""

from __future__ import annotations

from pathlib import Path

from rlsys.tools.tiny_parts import CHAT_TOKENS, TinyModelSpec, build_tokenizer

# Qwen2.5-VL's vision markers: an image is <|vision_start|><|image_pad|><|vision_end|> in a prompt's
# ids, the one <|image_pad|> expanded by the processor (or the engine) to one per merged patch.
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
PATCH_SIZE, TEMPORAL_PATCH_SIZE, MERGE_SIZE = 14, 2, 2
MIN_PIXELS, MAX_PIXELS = 28 * 28, 56 * 56
IMAGE_TOKENS_MAX = MAX_PIXELS // (PATCH_SIZE * MERGE_SIZE) ** 2
# ChatML, with a message's content either text or a list of parts ({"type": "image"} or
# {"type": "text", "text": ...}), as Qwen2.5-VL's own template renders them.
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}" + IMAGE_PLACEHOLDER + "{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VISION_DEPTH, VISION_HIDDEN, VISION_HEADS, VISION_INTERMEDIATE = 2, 32, 2, 64
# Qwen3-VL's patches are 16 pixels; its image processor then sizes an image to 32 x 32 .. 64 x 64
# pixels: the same 4 x 4 patch grid at most, 4 image tokens.
QWEN3_PATCH_SIZE = 16
QWEN3_MIN_PIXELS, QWEN3_MAX_PIXELS = 32 * 32, 64 * 64


def build_vlm_tokenizer():
    """The chat tokenizer with the four vision markers after Qwen's turn markers (special tokens, so
    the plain ids and the turn markers' do not move) and the template that renders images."""
    tokenizer = build_tokenizer(chat=True)
    tokenizer.add_special_tokens({"additional_special_tokens": CHAT_TOKENS + VISION_TOKENS})
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    return tokenizer


def vlm_config(spec: TinyModelSpec, tokenizer):
    """A Qwen2_5_VLConfig of `spec`'s text shapes, the tiny vision tower, and this tokenizer's ids."""
    from transformers import Qwen2_5_VLConfig

    head_dim = spec.hidden_size // spec.num_heads
    if head_dim % 8:
        raise ValueError(f"qwen2_5_vl needs a head size divisible by 8 for its 3-row RoPE sections, got {head_dim}")
    quarter = head_dim // 8  # mrope_section: (temporal, height, width) rotary pairs, adding up to head_dim / 2
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"))}
    text = dict(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings, initializer_range=spec.init_std,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                         "mrope_section": [2 * quarter, quarter, quarter]},
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    vision = dict(
        depth=VISION_DEPTH, hidden_size=VISION_HIDDEN, intermediate_size=VISION_INTERMEDIATE, num_heads=VISION_HEADS,
        in_channels=3, patch_size=PATCH_SIZE, temporal_patch_size=TEMPORAL_PATCH_SIZE, spatial_merge_size=MERGE_SIZE,
        window_size=PATCH_SIZE * MERGE_SIZE * 2, out_hidden_size=spec.hidden_size,
        fullatt_block_indexes=[VISION_DEPTH - 1], initializer_range=spec.init_std,
    )
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                            torch_dtype="float32", **ids)


def qwen3_vl_config(spec: TinyModelSpec, tokenizer):
    """A Qwen3VLConfig of `spec`'s text shapes (Qwen3: its own head_dim, q/k norms; interleaved
    3-row RoPE), a tiny vision tower with one deepstack merger, and this tokenizer's ids."""
    from transformers import Qwen3VLConfig

    base = vlm_config(spec, tokenizer)  # the ids and the text shapes, checked, as Qwen2.5-VL's
    text = base.text_config.to_dict()
    quarter = spec.hidden_size // spec.num_heads // 8
    text = {key: text[key] for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                        "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                                        "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id")}
    text.update(head_dim=spec.hidden_size // spec.num_heads, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                 "mrope_section": [2 * quarter, quarter, quarter], "mrope_interleaved": True})
    vision = dict(
        depth=VISION_DEPTH, hidden_size=VISION_HIDDEN, intermediate_size=VISION_INTERMEDIATE, num_heads=VISION_HEADS,
        in_channels=3, patch_size=QWEN3_PATCH_SIZE, temporal_patch_size=TEMPORAL_PATCH_SIZE,
        spatial_merge_size=MERGE_SIZE, out_hidden_size=spec.hidden_size, num_position_embeddings=16,
        deepstack_visual_indexes=[0], hidden_act="gelu_pytorch_tanh", initializer_range=spec.init_std,
    )
    ids = {name: getattr(base, name) for name in ("image_token_id", "video_token_id", "vision_start_token_id",
                                                    "vision_end_token_id")}
    config = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    config.dtype = "float32"
    return config


def vlm_processor(tokenizer, arch: str = "qwen2_5_vl"):
    """The model's processor (Qwen2.5-VL's, or Qwen3-VL's): its image and video processors at the
    tiny patch grid, this tokenizer."""
    from transformers import Qwen2_5_VLProcessor, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    if arch == "qwen3_vl":
        size = {"shortest_edge": QWEN3_MIN_PIXELS, "longest_edge": QWEN3_MAX_PIXELS}
        grid = dict(patch_size=QWEN3_PATCH_SIZE, temporal_patch_size=TEMPORAL_PATCH_SIZE, merge_size=MERGE_SIZE)
        return Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(size=size, **grid),
                                video_processor=Qwen3VLVideoProcessor(size=size, **grid),
                                tokenizer=tokenizer, chat_template=VLM_CHAT_TEMPLATE)
    size = {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
    grid = dict(patch_size=PATCH_SIZE, temporal_patch_size=TEMPORAL_PATCH_SIZE, merge_size=MERGE_SIZE)
    return Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessor(size=size, **grid),
                               video_processor=Qwen2VLVideoProcessor(size=size, **grid),
                               tokenizer=tokenizer, chat_template=VLM_CHAT_TEMPLATE)


def make_tiny_vlm(out_dir: Path, spec: TinyModelSpec, save_tokenizer) -> Path:
    """Write the processor (tokenizer, image and video processors, chat template) and a random-init
    Qwen2.5-VL (or, spec.arch qwen3_vl, Qwen3-VL) of `spec`'s text shapes (fp32, untied head) to `out_dir`."""
    import torch
    from transformers import GenerationConfig, Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration

    tokenizer = build_vlm_tokenizer()
    for directory in (out_dir, out_dir / "tokenizer"):
        save_tokenizer(tokenizer, directory)
    vlm_processor(tokenizer, spec.arch).save_pretrained(str(out_dir))
    qwen3 = spec.arch == "qwen3_vl"
    config = qwen3_vl_config(spec, tokenizer) if qwen3 else vlm_config(spec, tokenizer)
    torch.manual_seed(spec.seed)
    model = (Qwen3VLForConditionalGeneration if qwen3 else Qwen2_5_VLForConditionalGeneration)(config).to(torch.float32)
    model.save_pretrained(str(out_dir), safe_serialization=True)  # the released checkpoints' names
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(
        str(out_dir))
    return out_dir
