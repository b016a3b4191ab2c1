"""How a trainer's model is laid out on its ranks: dtype policy, gradient checkpointing, and
FSDP2 `fully_shard` per decoder layer and then the root. The one place that decides sharding."""

from __future__ import annotations

import torch


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks, as transformers names them (`_no_split_modules`)."""
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in block_names]
    if not layers:
        raise ValueError(f"cannot find decoder layers to shard in {type(model).__name__}")
    return layers


def parallelize(model: torch.nn.Module, mesh, dtype: str, trainable: bool, gradient_checkpointing: bool,
                pin_memory: bool) -> torch.nn.Module:
    """Shard `model` over `mesh` in place (or leave it whole when `mesh` is None).

    bfloat16: parameters are cast to bf16 for compute and gradients reduced in fp32, while the
    sharded master weights stay fp32. A frozen model (the reference) lives on the host and
    streams to the device layer by layer (`CPUOffloadPolicy`); pinned buffers need an accelerator.
    """
    if trainable and gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if mesh is not None:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        kwargs = {"mesh": mesh, "mp_policy": MixedPrecisionPolicy()}
        if dtype == "bfloat16":
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if not trainable:
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=pin_memory)
        for layer in decoder_layers(model):
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
    model.requires_grad_(trainable)
    model.train(trainable)
    return model
