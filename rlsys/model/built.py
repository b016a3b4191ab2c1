"""The policy the trainer ranks build, on the meta device (shapes only): the model config.json
describes, with model.lora's adapters, refused when the adapters cannot be placed as asked."""

from __future__ import annotations

from pathlib import Path

from rlsys.config import ConfigError, LoraConfig


def trained_model(model_dir: Path, lora: LoraConfig | None):
    """The policy the trainer ranks build (meta device: shapes only), with model.lora's adapters;
    ConfigError when target_modules match no module."""
    import torch

    from rlsys.actors.loading import build_empty_model
    from rlsys.actors.lora import AdapterTargetError, UnsupportedAdapterTargetError, add_adapters

    model = build_empty_model(str(model_dir), "sdpa")
    if lora is None:
        return model
    linear = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                     if isinstance(module, torch.nn.Linear)} - {"lm_head"})
    try:
        add_adapters(model, lora.rank, lora.alpha, lora.dropout, lora.target_modules)
    except AdapterTargetError as error:
        raise ConfigError(f"invalid config: model.lora.target_modules {lora.target_modules} match no module of "
                          f"{model_dir} ({error}); its linear layers are {', '.join(linear)}, or use all-linear") from None
    except UnsupportedAdapterTargetError as error:
        raise ConfigError(f"invalid config: model.lora.target_modules {lora.target_modules} put adapters on modules "
                          f"of {model_dir} that are not linear layers ({error}: a mixture-of-experts model's stacked "
                          "experts or router); rlsys merges adapters into linear layers only: list target_modules "
                          f"from its linear layers, {', '.join(linear)}") from None
    _refuse_rank_above_the_adapted_dimensions(model, lora.rank)
    return model


def _refuse_rank_above_the_adapted_dimensions(model, rank: int) -> None:
    """B A of a layer with in -> out features has rank at most min(in, out): a larger model.lora.rank
    adds parameters, optimizer state and time that can never change the update."""
    dimensions = {name: min(module.base_layer.in_features, module.base_layer.out_features)
                  for name, module in model.named_modules()
                  if hasattr(module, "lora_A") and hasattr(module.base_layer, "in_features")}
    if not dimensions:
        return
    name, smallest = min(dimensions.items(), key=lambda item: item[1])
    if rank > smallest:
        raise ConfigError(f"invalid config: model.lora.rank {rank} is above the smallest dimension of the layers it "
                          f"adapts ({smallest}: {name}); a rank above min(in, out) of a layer cannot change its "
                          f"update and only costs memory: use model.lora.rank <= {smallest}, or target_modules "
                          "without that layer")
