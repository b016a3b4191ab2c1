"""A model directory's config.json, and the architecture transformers makes of it: read once
here, so that the driver (config.json alone), trainer rank 0, `rlsys plan` and `rlsys eval` refuse
the same models with the same messages."""

from __future__ import annotations

import json
from pathlib import Path

from rlsys.config import ConfigError


def read_model_config(model_dir: str | Path) -> dict:
    """The model's config.json, refused here (trainers, engines and `rlsys plan` all read it) when it
    is not a JSON object."""
    path = Path(model_dir) / "config.json"
    try:
        model_config = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"invalid config: model.path {model_dir}: {path} is not valid JSON ({error}); "
                          "point model.path at a complete Hugging Face checkpoint") from None
    if not isinstance(model_config, dict):
        raise ConfigError(f"invalid config: model.path {model_dir}: {path} must hold a JSON object, "
                          f"not a {type(model_config).__name__}")
    return model_config


# Vision-language model types rlsys trains: their multimodal rotary positions for still images are Qwen2.5-VL's
# (rlsys/multimodal/positions.py) and SGLang's weight names theirs (actors/checkpoint_layout.py).
VISION_LANGUAGE_MODEL_TYPES = ("qwen2_5_vl", "qwen3_vl")


def text_settings(model_config: dict) -> dict:
    """A model's text-model settings as its config.json states them: a vision-language model's
    `text_config` where it has one (transformers 5 writes one), else the top level."""
    text = model_config.get("text_config")
    return {**model_config, **text} if isinstance(text, dict) else model_config


def refuse_untrained_vision_language(model_dir: str | Path, model_config: dict) -> None:
    if model_config.get("model_type") not in VISION_LANGUAGE_MODEL_TYPES:
        named = f"model type {model_config.get('model_type')!r} (architectures {model_config.get('architectures')})"
        raise ConfigError(f"invalid config: model.path {model_dir}: {named} is a vision-language model rlsys does "
                          f"not train; it trains {', '.join(VISION_LANGUAGE_MODEL_TYPES)} (Qwen2.5-VL, Qwen3-VL)")


def read_architecture(model_dir: str | Path):
    """The model's transformers config, refused with a ConfigError when transformers cannot build a
    causal LM from it (a model type it does not know, or one that is no causal LM) or it is a
    vision-language model of another type than VISION_LANGUAGE_MODEL_TYPES, before anything starts.
    A vision-language model's text model is `.get_text_config()` (the text model's own config is itself)."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_config = read_model_config(model_dir)
    named = f"model type {model_config.get('model_type')!r} (architectures {model_config.get('architectures')})"
    try:
        config = AutoConfig.from_pretrained(str(model_dir))
    except (TypeError, StrictDataclassError) as error:  # a field of the wrong type ("vocab_size": "eighty")
        reason = " ".join(str(error).split())  # huggingface_hub's is two lines: the field, then the TypeError
        raise ConfigError(f"invalid config: model.path {model_dir}: {Path(model_dir) / 'config.json'}: {reason}; "
                          "fix the field or point model.path at a complete Hugging Face checkpoint") from None
    except (OSError, ValueError, KeyError) as error:  # a model_type this transformers does not know
        reason = str(error).split(". ")[0]
        raise ConfigError(f"invalid config: model.path {model_dir}: transformers cannot read its config.json, "
                          f"{named}: {reason}; rlsys trains the architectures in docs/gpus-and-clusters.md "
                          "(Qwen2, Qwen3, Llama, Qwen3-MoE): point model.path at one of those") from None
    if "vision_config" in model_config:
        refuse_untrained_vision_language(model_dir, {**model_config, "model_type": config.model_type})
        return config
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ConfigError(f"invalid config: model.path {model_dir}: {named} is not a causal language model "
                          "transformers can build (AutoModelForCausalLM); rlsys trains the architectures in "
                          "docs/gpus-and-clusters.md (Qwen2, Qwen3, Llama, Qwen3-MoE)")
    return config
