"""model: the policy model (its path, dtype, tokenizer) and LoRA."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from rlsys.section import Section


class LoraConfig(Section):
    """LoRA adapters (PEFT) on the policy: only they train; the reference is the same model with them off."""

    rank: int = Field(16, ge=1, description="Rank r of each adapter (A: r x in, B: out x r).")
    alpha: float = Field(32.0, gt=0, description="Scale numerator: the update is (alpha / rank) * B A.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' input in training "
                           "mode, the trainer's log-prob passes included: keep 0 for exact old log-probs and TIS.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="Module names (suffixes, as PEFT matches them) that get adapters, or all-linear: "
        "every linear layer of the decoder (never the output layer).",
    )

    @field_validator("target_modules")
    @classmethod
    def _some_modules(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("name at least one module, or all-linear")
        return value


class ModelConfig(Section):
    path: str = Field(
        description="Local directory of a Hugging Face checkpoint, or a hub id (`Qwen/Qwen2.5-7B-Instruct`) resolved "
        "through huggingface_hub's cache (HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE; downloaded when online) to one "
        "commit's snapshot, the same on every node.",
    )
    revision: str | None = Field(
        None, description="Branch, tag or commit of a hub id model.path (default: main). The run pins the commit it "
        "resolves to (config.yaml in the run directory records it).",
    )
    hub_id: str | None = Field(
        None, description="Set by rlsys when model.path was a hub id: the id, model.path then naming its snapshot "
        "directory (other nodes resolve the id at model.revision and must find it at that path).",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Compute dtype of the trainer ranks and the engines. bfloat16: FSDP2 mixed precision "
        "(bf16 params, fp32 reduce; master weights stay fp32) and flash-attn 2 on GPU when installed. Engines on GPUs "
        "always serve bfloat16 (SGLang's CUDA RMSNorm kernel takes 16-bit only): an fp32 trainer's weights are cast "
        "to bf16 at every sync, and weight_sync.verify bounds them by bf16 rounding.",
    )
    tokenizer_path: str | None = Field(
        None, description="Local directory (or hub id) of the tokenizer when it is not model.path's (the engine gets "
        "it as --tokenizer-path).",
    )

    lora: LoraConfig | None = Field(
        None, description="Train LoRA adapters instead of every weight (null: full fine-tuning). The engines get "
        "merged weights (W + alpha/rank * B A) at every sync.",
    )
    freeze_vision: bool = Field(
        False, description="A vision-language model: keep its vision tower (and the merger into the language model) "
        "as loaded; only the language model trains, and weight syncs send only it.",
    )

    @property
    def tokenizer_dir(self) -> str:
        return self.tokenizer_path or self.path
