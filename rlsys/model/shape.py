"""The model's shapes as the memory plan reads them: from config.json alone, the model built on
the meta device (no weights read). Parameters in all, in the largest decoder layer and outside the
layers, every tensor's shape (FSDP pads each one's dim 0; the weight sync stages the largest), the
attention's heads, the MLP width a token passes through, and model.lora's adapters."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlsys.config import ConfigError
from rlsys.model.architecture import read_architecture
from rlsys.model.built import trained_model

GiB = 2**30  # the unit the plan reports in


@dataclass(frozen=True)
class VisionShape:
    """A vision tower's shapes, as the plan sizes its activations (Qwen2.5-VL's vision_config)."""

    hidden: int
    intermediate: int
    blocks: int
    heads: int
    patches_per_token: int  # spatial_merge_size squared: patches the merger folds into one image token

    @classmethod
    def of(cls, vision_config) -> VisionShape:
        merge = getattr(vision_config, "spatial_merge_size", 1) or 1
        return cls(hidden=vision_config.hidden_size, intermediate=vision_config.intermediate_size,
                   blocks=vision_config.depth, heads=vision_config.num_heads, patches_per_token=merge * merge)


@dataclass(frozen=True)
class ModelShape:
    params: int  # distinct parameters (tied weights once)
    layer_params: int  # the largest decoder layer's
    root_params: int  # everything outside the decoder layers
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    # Shapes, for what is sized per tensor: FSDP pads each one's dim 0 to a multiple of the ranks,
    # and the weight-sync staging buffer holds at least the largest (named_parameters order).
    # The MLP width a token passes through: intermediate for a dense model; for a mixture of experts
    # its top-k routed experts' (and a shared expert's) widths added up.
    active_intermediate: int = 0
    # model.lora: the adapters' parameters (all layers; the largest layer's): the only ones that
    # train, so the only ones with gradients and AdamW moments.
    adapter_params: int = 0
    layer_adapter_params: int = 0
    param_shapes: tuple[tuple[int, ...], ...] = ()
    layer_shapes: tuple[tuple[int, ...], ...] = ()  # the largest decoder layer's
    root_shapes: tuple[tuple[int, ...], ...] = ()  # outside the decoder layers (embeddings, norm, lm_head)
    # A vision-language model's vision tower (0 for a text model): its blocks' width, MLP width,
    # heads and depth, and how many of its patches merge into one image token of the language model.
    vision: VisionShape | None = None

    @classmethod
    def from_model_dir(cls, path: str | Path, lora=None) -> ModelShape:
        import torch
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        from rlsys.actors.loading import is_vision_language
        from rlsys.actors.parallelize import decoder_layers

        if not (Path(path) / "config.json").is_file():
            raise ConfigError(f"model.path {path} has no config.json (the memory plan reads the model's shapes)")
        architecture = read_architecture(path)
        vision_language = is_vision_language(architecture)
        with torch.device("meta"):
            model = (AutoModelForImageTextToText if vision_language else AutoModelForCausalLM).from_config(architecture)
        # A vision-language model's layers are its language model's; its vision tower counts with
        # what lies outside them (the plan holds it gathered whole: more than FSDP's per-block gathers).
        config = architecture.get_text_config()
        adapters: dict[int, int] = {}  # id(decoder layer) -> its adapters' parameters
        if lora is not None:
            adapted = trained_model(Path(path), lora)
            for layer in decoder_layers(adapted):
                adapters[id(layer)] = sum(p.numel() for n, p in layer.named_parameters() if ".lora_" in n)
        params = sum(p.numel() for p in model.parameters())
        layers = decoder_layers(model.get_decoder() if vision_language else model)
        layer_params = [sum(p.numel() for p in layer.parameters()) for layer in layers]
        largest = layers[layer_params.index(max(layer_params))]
        in_layers = {id(p) for layer in layers for p in layer.parameters()}
        heads = config.num_attention_heads
        return cls(
            params=params, layer_params=max(layer_params), root_params=params - sum(layer_params),
            hidden=config.hidden_size, intermediate=config.intermediate_size, layers=len(layers), heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads, vocab=config.vocab_size,
            active_intermediate=_active_intermediate(config),
            adapter_params=sum(adapters.values()), layer_adapter_params=max(adapters.values(), default=0),
            param_shapes=tuple(tuple(p.shape) for _, p in model.named_parameters()),
            layer_shapes=tuple(tuple(p.shape) for p in largest.parameters()),
            root_shapes=tuple(tuple(p.shape) for p in model.parameters() if id(p) not in in_layers),
            vision=VisionShape.of(architecture.vision_config) if vision_language else None,
        )


def _active_intermediate(config) -> int:
    routed = getattr(config, "num_experts_per_tok", None)
    expert_width = getattr(config, "moe_intermediate_size", None)
    if not (routed and expert_width):
        return config.intermediate_size
    return routed * expert_width + (getattr(config, "shared_expert_intermediate_size", None) or 0)
