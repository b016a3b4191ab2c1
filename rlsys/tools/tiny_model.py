"""Build a tiny random-init model (Qwen2, Qwen3, Llama, Qwen3-MoE, or the vision-language Qwen2.5-VL:
rlsys/tools/tiny_vlm.py) and a character-level tokenizer into a local directory.

Nothing here touches a model hub: the tokenizer is built with transformers' Qwen2 tokenizer class and the
model from its transformers config class, then both are saved in the Hugging Face format that
SGLang and transformers load from disk.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlsys.errors import UsageError, why_not_a_directory
from rlsys.tools.tiny_parts import ARCHITECTURES, VISION_LANGUAGE, TinyModelSpec, build_tokenizer
from rlsys.tools.tiny_vlm import make_tiny_vlm


def _make_output_dir(out_dir: str | Path) -> Path:
    """`out_dir`, created if missing; an existing file there, or a path that cannot be a directory,
    is refused (UsageError) before anything is written."""
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(f"cannot write to {out_dir}: {why_not_a_directory(out_dir, error)}; "
                         "choose another output directory") from None
    return out_dir


def make_tiny_model(out_dir: str | Path, spec: TinyModelSpec | None = None, chat: bool = False) -> Path:
    """Write a tokenizer and a random-init model of `spec.arch` (fp32, untied head) to `out_dir`;
    `chat`: the tokenizer has a chat template in its tokenizer_config, as Qwen's instruct models do.
    `spec` None: TinyModelSpec()'s defaults (the quickstart's model)."""
    import torch
    import transformers
    from transformers import GenerationConfig

    spec = spec or TinyModelSpec()
    out_dir = _make_output_dir(out_dir)
    if spec.arch in VISION_LANGUAGE:  # a chat model with a processor, whatever `chat` says
        return make_tiny_vlm(out_dir, spec, _save_tokenizer)
    tokenizer = build_tokenizer(chat)
    # Twice: beside the model, and alone in tokenizer/ (for model.tokenizer_path: the same tokenizer
    # from a directory of its own).
    for directory in (out_dir, out_dir / "tokenizer"):
        _save_tokenizer(tokenizer, directory)

    # Exactly the tokenizer's size: an unused id could be sampled and would decode to nothing.
    vocab_size = len(tokenizer)
    config_class, model_class = (getattr(transformers, name) for name in ARCHITECTURES[spec.arch])
    config = config_class(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
        initializer_range=spec.init_std,
        **spec.config_fields(),
    )
    torch.manual_seed(spec.seed)
    model = model_class(config).to(torch.float32)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    ).save_pretrained(str(out_dir))
    return out_dir


def _save_tokenizer(tokenizer, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(directory))
    config_path = directory / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    template = directory / "chat_template.jinja"
    if template.is_file():  # inside tokenizer_config.json, where Qwen's releases keep it
        tokenizer_config["chat_template"] = template.read_text()
        template.unlink()
    config_path.write_text(json.dumps(tokenizer_config, indent=2))


# Published Hugging Face config.json values (shapes only) of models the memory tools are checked on.
PUBLISHED_SHAPES = {
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                         tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6),
}


def write_random_checkpoint(out_dir: str | Path, shape: str, dtype: str = "bfloat16") -> int:
    """A published model's config.json and random weights of its exact shapes, written one tensor
    at a time (bf16 files, as released checkpoints are); returns the model's fp32 bytes (what a
    trainer holds in fp32 master weights). No tokenizer: for loading and memory measurements."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = Qwen2Config(**PUBLISHED_SHAPES[shape], torch_dtype=dtype)
    config.save_pretrained(str(out_dir))
    with torch.device("meta"):
        skeleton = Qwen2ForCausalLM(config)
    generator = torch.Generator().manual_seed(0)
    tensors, numel = {}, 0
    for name, param in skeleton.named_parameters():  # tied weights appear once
        tensors[name] = (torch.randn(param.shape, generator=generator) * 0.02).to(getattr(torch, dtype))
        numel += param.numel()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return numel * 4
