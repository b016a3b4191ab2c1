"""What a tiny model is made of before it is built: its spec (`TinyModelSpec`: the shapes and the
architecture), the architectures' config classes, and the character-level tokenizer (with Qwen's
chat tokens and template when asked). rlsys/tools/tiny_model.py and rlsys/tools/tiny_vlm.py build
models from these."""

from __future__ import annotations

import math
import string
from dataclasses import dataclass

from rlsys.errors import UsageError

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
        if self.arch in VISION_LANGUAGE and (self.hidden_size // self.num_heads % 8 or self.intermediate_size % 32):
            # the 3-row RoPE splits a head's rotary pairs in four quarters (2:1:1); SGLang pads an
            # intermediate size to a multiple of 32 on the CPU, which would change the weights' shapes
            raise UsageError(f"--arch {self.arch} needs a head size (--hidden-size / --num-heads) divisible by 8 and an "
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
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration"),  # Qwen3 text, deepstack vision: tiny_vlm.py
}
VISION_LANGUAGE = ("qwen2_5_vl", "qwen3_vl")


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
