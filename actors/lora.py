"""LoRA on the policy (model.lora): PEFT's adapters injected into the transformers model in place.

- **Names.** `peft.inject_adapter_in_model` keeps the model's class and module tree: an adapted
  linear layer `...q_proj` becomes a `peft.tuners.lora.Linear` holding the original as
  `base_layer` and the adapters as `lora_A.default` (r x in) and `lora_B.default` (out x r). The
  checkpoint and the engines know only `...q_proj.weight`: `checkpoint_name` strips `base_layer`.
- **Training.** Only adapter parameters require gradients (set before sharding: FSDP2 keeps each
  parameter's flag); the base stays in the FSDP groups, gathered for compute, never reduced.
- **The reference** is the same model with the adapters off (`adapters_disabled`): no second copy.
- **Initial adapters** as PEFT's `LoraLayer.reset_lora_parameters` makes them (A: Kaiming-uniform
  with a = sqrt(5), B: zeros, so the policy starts as the base), but drawn from a generator seeded
  per parameter name, the same on every rank and every run.
- **The engines** get merged weights W + scale * B A (`merged_parameters`), one tensor at a time
  during the sync's gather: each rank merges its own rows of W (FSDP2 shards W and B by the same
  output rows) with the small A gathered whole, so the merged tensor has W's sharding and goes
  through the same gathers as any parameter.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

ADAPTER_NAME = "default"  # PEFT's name for a model's only adapter
_BASE = ".base_layer."


class AdapterTargetError(ValueError):
    """model.lora.target_modules names no module of the model."""


class UnsupportedAdapterTargetError(ValueError):
    """model.lora.target_modules reaches modules other than linear layers (a mixture-of-experts
    model's stacked experts or its router, which PEFT wraps as parameters): rlsys merges adapters
    into linear weights only. `modules`: their names, one per kind."""

    def __init__(self, modules: list[str]):
        super().__init__(", ".join(modules))
        self.modules = modules


# A vision-language model's vision tower takes no adapters: LoRA adapts its language model (as
# verl and TRL do for Qwen2.5-VL); a module name that matches in full is left out (PEFT's exclude_modules).
VISION_TOWER_MODULES = r"(.*\.)?visual(\..*)?"


def lora_settings(model_config, rank: int, alpha: float, dropout: float, target_modules: list[str] | str, **extra):
    """PEFT's LoraConfig for model.lora on a model of `model_config` (the trainer's and the export's)."""
    from peft import LoraConfig

    vision = getattr(model_config, "vision_config", None) is not None
    return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules, bias="none",
                      exclude_modules=VISION_TOWER_MODULES if vision else None, **extra)


def add_adapters(model: torch.nn.Module, rank: int, alpha: float, dropout: float,
                 target_modules: list[str] | str) -> torch.nn.Module:
    """Inject LoRA adapters into `model` in place (its parameters may be on the meta device); a
    vision-language model's language model only."""
    from peft import inject_adapter_in_model

    config = lora_settings(model.config, rank, alpha, dropout, target_modules)
    try:
        inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
    except ValueError as error:
        if "not found in the base model" in str(error) or "No modules were targeted" in str(error):
            raise AdapterTargetError(str(error).split(". ")[0]) from None
        raise
    # PEFT's "all-linear" also wraps a transformers-5 MoE's stacked experts and router (ParamWrapper)
    from peft.tuners.lora import LoraLayer

    not_linear = {type(layer.get_base_layer()).__name__: name.replace(".base_layer", "")
                  for name, layer in model.named_modules()
                  if isinstance(layer, LoraLayer) and not isinstance(layer.get_base_layer(), torch.nn.Linear)}
    if not_linear:
        raise UnsupportedAdapterTargetError(sorted(not_linear.values()))
    return model


def adapter_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from peft.tuners.lora import LoraLayer

    return [module for module in model.modules() if isinstance(module, LoraLayer)]


def has_adapters(model: torch.nn.Module) -> bool:
    return bool(adapter_layers(model))


def is_adapter_parameter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def checkpoint_name(name: str) -> str:
    """The name a parameter has in the Hugging Face checkpoint (and the engine): without `base_layer`."""
    return name.replace(_BASE, ".")


@contextmanager
def adapters_disabled(model: torch.nn.Module):
    """The base model: every adapter off (PEFT's `enable_adapters`; it clears the adapters'
    requires_grad while off and sets it again when they come back)."""
    layers = adapter_layers(model)
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def initial_adapter(name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """The full initial value of adapter parameter `name` (module docstring)."""
    if ".lora_B." in name:
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed(seed ^ int(hashlib.sha256(name.encode()).hexdigest()[:12], 16))
    fan_in = shape[1]
    bound = math.sqrt(6 / ((1 + 5) * fan_in))  # kaiming_uniform_(a=sqrt(5)): gain sqrt(2 / (1 + a^2))
    return torch.empty(shape).uniform_(-bound, bound, generator=generator)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def merged_parameters(model: torch.nn.Module) -> tuple[list[tuple[str, torch.Tensor]],
                                                       Callable[[str, torch.Tensor], torch.Tensor]]:
    """(the engine's parameters as (checkpoint name, a parameter of the same shape and layout),
    a function that turns one of them into the tensor to send). The first list only stands for
    the tensors (bucketing reads shapes); `merge(name, tensor)` computes an adapted weight's
    W + scale * B A when its bucket is gathered (a collective for sharded A: every rank calls it
    for the same names in the same order) and returns any other tensor as it is."""
    layers = set(adapter_layers(model))
    adapted = {f"{name}.weight": module for name, module in model.named_modules() if module in layers}
    listed = [(checkpoint_name(name), param) for name, param in model.named_parameters()
              if not is_adapter_parameter(name)]

    def merge(name: str, tensor: torch.Tensor) -> torch.Tensor:
        layer = adapted.get(name)
        if layer is None:
            return tensor
        weight = layer.base_layer.weight.detach()
        a = _full(layer.lora_A[ADAPTER_NAME].weight.detach())
        b = layer.lora_B[ADAPTER_NAME].weight.detach()
        scale = layer.scaling[ADAPTER_NAME]
        if not hasattr(weight, "to_local"):
            return torch.addmm(weight, b, a, alpha=scale)
        from torch.distributed.tensor import DTensor

        if b.placements != weight.placements:
            raise ValueError(f"{name}: the adapter's B is laid out as {b.placements}, its weight as {weight.placements}")
        local = torch.addmm(weight.to_local(), b.to_local(), a.to(weight.to_local().dtype), alpha=scale)
        return DTensor.from_local(local, weight.device_mesh, weight.placements, shape=weight.shape,
                                  stride=weight.stride(), run_check=False)

    return listed, merge


def adapter_state(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapter parameters under PEFT's saved names (`base_model.model.` + name without the
    adapter name), as `PeftModel.from_pretrained` loads them."""
    for name, param in model.named_parameters():
        if is_adapter_parameter(name):
            yield "base_model.model." + name.replace(f".{ADAPTER_NAME}.", "."), param
