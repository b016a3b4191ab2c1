"""Build a tiny random-init model (Qwen2, Qwen3, Llama, Qwen3-MoE, or the vision-language Qwen2.5-VL:
rlsys/tools/tiny_vlm.py) and a character-level tokenizer into a local directory.

Nothing here touches a model hub: the tokenizer is built with transformers' Qwen2 tokenizer class and the
model from its transformers config class, then both are saved in the Hugging Face format that
SGLang and transformers load from disk.
"""

from __future__ import annotations

import json
import math
import string
from dataclasses import dataclass
from pathlib import Path

from rlsys.errors import UsageError, why_not_a_directory

SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>"]
# Every printable ASCII character except the ones that tokenizers treat specially in vocab files.
CHARACTERS = list(string.digits + string.ascii_lowercase + string.ascii_uppercase + " +-*/=?:>,.()[]")


@dataclass(frozen=True)
class TinyModelSpec:
    """Architecture of the tiny model; defaults give 133,696 parameters (qwen2; 80-token vocabulary)."""

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 512
    seed: int = 0
    arch: str = "qwen2"  # a key of ARCHITECTURES
    num_experts: int = 4  # qwen3_moe only
    num_experts_per_tok: int = 2
    # Std of the random weights (transformers' initializer_range). At 0.02 a 64-wide model's output
    # layer can only spread its logits over ~+-1.3 (its input is RMS-normalised): full fine-tuning
    # grows it, but LoRA leaves it frozen, so a LoRA run needs a base with a wider range (~0.1), as
    # a pretrained model has.
    init_std: float = 0.02

    def __post_init__(self):
        # Rotary embeddings rotate pairs of a head's dimensions: each head needs an even size.
        if self.hidden_size <= 0 or self.hidden_size % (2 * self.num_heads):
            raise UsageError(f"--hidden-size must be a positive multiple of {2 * self.num_heads} ({self.num_heads} "
                             f"attention heads of an even size), got {self.hidden_size}")
        if self.num_layers < 1:
            raise UsageError(f"--num-layers must be at least 1, got {self.num_layers}")
        if not math.isfinite(self.init_std) or self.init_std < 0:
            raise UsageError(f"--init-std must be a finite number >= 0, got {self.init_std}")
        if self.arch not in ARCHITECTURES:
            raise UsageError(f"--arch must be one of {', '.join(ARCHITECTURES)}, got {self.arch!r}")
        if self.arch == "qwen2_5_vl" and (self.hidden_size // self.num_heads % 8 or self.intermediate_size % 32):
            # the 3-row RoPE splits a head's rotary pairs in four quarters (2:1:1); SGLang pads an
            # intermediate size to a multiple of 32 on the CPU, which would change the weights' shapes
            raise UsageError("--arch qwen2_5_vl needs a head size (--hidden-size / --num-heads) divisible by 8 and an "
                             f"--intermediate-size divisible by 32, got {self.hidden_size // self.num_heads} and "
                             f"{self.intermediate_size}")

    def config_fields(self) -> dict:
        """The architecture's own config fields for these shapes (beyond the shared ones)."""
        if self.arch == "qwen2":
            return {}
        if self.arch == "llama":
            return {"attention_bias": False, "mlp_bias": False}
        fields = {"head_dim": self.hidden_size // self.num_heads}  # Qwen3 sets it apart from hidden / heads
        if self.arch == "qwen3_moe":
            fields.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                          moe_intermediate_size=self.intermediate_size // 2, decoder_sparse_step=1,
                          norm_topk_prob=True, mlp_only_layers=[])
        return fields


# --arch -> (transformers config class, model class); what each differs in where rlsys does its
# own work: Qwen2 has q/k/v biases; Qwen3 has none but per-head q/k RMSNorms and its own head_dim;
# Llama neither; Qwen3-MoE is Qwen3 with routed experts in every layer.
ARCHITECTURES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"),  # with its processor: tiny_vlm.py
}


# Chat variant: Qwen's turn markers (special tokens at the end of the vocabulary, so the plain
# ids do not move), a newline token, and Qwen's ChatML layout as a Jinja template.
CHAT_TOKENS = ["<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(chat: bool = False):
    """A character-level tokenizer: every character is one token; decoding concatenates. With
    `chat`, also "\n", Qwen's <|im_start|>/<|im_end|> and its chat template, <|im_end|> as EOS.

    Built as what it is served as: a Qwen2 tokenizer (byte-level BPE) with no merges, so each
    character stays one token. transformers' AutoTokenizer builds a Qwen2Tokenizer for any
    directory whose config.json says qwen2, whatever tokenizer_config names (qwen2 is in its
    MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS), from tokenizer.json's vocabulary and merges: a
    tokenizer of another kind there (the word-level one this was) lost its spaces, so `generate` on
    an export disagreed with `rlsys eval`. Characters outside the vocabulary are dropped, as Qwen2's
    BPE (unk_token None) drops them."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    as_bytes = bytes_to_unicode()  # byte-level BPE's spelling of each byte (" " is "Ġ", "\n" is "Ċ")
    characters = ["".join(as_bytes[b] for b in c.encode()) for c in CHARACTERS + (["\n"] if chat else [])]
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + characters + (CHAT_TOKENS if chat else []))}
    if not chat:
        return Qwen2Tokenizer(vocab=vocab, merges=[], unk_token="<unk>", eos_token="<eos>", pad_token="<pad>")
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token="<unk>", eos_token="<|im_end|>", pad_token="<pad>",
                               additional_special_tokens=CHAT_TOKENS)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


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


def make_tiny_model(out_dir: str | Path, spec: TinyModelSpec = TinyModelSpec(), chat: bool = False) -> Path:
    """Write a tokenizer and a random-init model of `spec.arch` (fp32, untied head) to `out_dir`;
    `chat`: the tokenizer has a chat template in its tokenizer_config, as Qwen's instruct models do."""
    import torch
    import transformers
    from transformers import GenerationConfig

    out_dir = _make_output_dir(out_dir)
    if spec.arch == "qwen2_5_vl":  # a chat model with a processor, whatever `chat` says
        from rlsys.tools.tiny_vlm import make_tiny_vlm

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
