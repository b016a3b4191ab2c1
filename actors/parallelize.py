"""How a trainer's model is laid out on its ranks: dtype policy, gradient checkpointing, and
FSDP2 `fully_shard` per decoder layer and then the root. The one place that decides sharding."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the memory plan reads `uses_fsdp` in processes that never import torch
    import torch


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks, as transformers names them (`_no_split_modules`)."""
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in block_names]
    if not layers:
        raise ValueError(f"cannot find decoder layers to shard in {type(model).__name__}")
    return layers


def uses_fsdp(world_size: int, dtype: str, trainable: bool) -> bool:
    """Whether FSDP has work to do for this model. It does with several ranks (sharding), with a
    compute dtype other than the fp32 master weights (its mixed-precision cast), and for a frozen
    model (it streams from host memory layer by layer). A trainable fp32 model on one rank is left
    whole: FSDP would only copy every layer's parameters into separate compute buffers before each
    forward and backward and the gradients back out (at one rank: ~6 of a 0.3M model's 23 ms step
    and ~70 of a 9.5M model's 2 s step on a CPU) and hold a second copy of each layer meanwhile."""
    return world_size > 1 or dtype != "float32" or not trainable


def parallelize(model: torch.nn.Module, mesh, dtype: str, trainable: bool, gradient_checkpointing: bool,
                trains: Callable[[str], bool] | None = None, on_host: bool | None = None) -> torch.nn.Module:
    """Shard `model` over `mesh` in place (or leave it whole when `mesh` is None).

    bfloat16: parameters are cast to bf16 for compute and gradients reduced in fp32, while the
    sharded master weights stay fp32. A frozen model (the reference) lives on the host and
    streams to the device layer by layer (`CPUOffloadPolicy`); on a GPU host `pin_host_shards`
    page-locks its shards once they hold the weights.
    `trains(name)`: which parameters of a trainable model learn (LoRA: the adapters only); set
    before sharding, since FSDP2 gives each sharded parameter its original's requires_grad.
    `on_host`: whether a frozen model's shards live on the host (default; False: on the device,
    trainer.reference_placement), gathered from there for each forward.
    """
    on_host = not trainable if on_host is None else on_host
    for name, param in model.named_parameters():
        param.requires_grad_(trainable and (trains is None or trains(name)))
    if trainable and gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if mesh is not None:
        import torch
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        kwargs = {"mesh": mesh, "mp_policy": MixedPrecisionPolicy()}
        if dtype == "bfloat16":
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if on_host:
            # Not FSDP's pinning: with pin_memory=True, FSDPParam.reset_sharded_param
            # (torch/distributed/fsdp/_fully_shard/_fsdp_param.py) copies every shard through
            # `.cpu().pin_memory()` into torch's caching host allocator, which rounds each up to a
            # power of two and keeps it (~1.9x the model's bytes). `pin_host_shards` page-locks them
            # in place instead, at exactly their bytes.
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
        for layer in decoder_layers(model):
            fully_shard(layer, **kwargs)
        # Left to FSDP, the root is never resharded after forward (FSDPState._lazy_init in
        # torch/distributed/fsdp/_fully_shard/_fsdp_state.py clears the root's post_forward_mesh_info
        # when reshard_after_forward is not given): only a backward reshards it. The frozen
        # reference never runs one, so its root (embeddings, output layer) asks for it explicitly
        # and goes back to the host after every forward like its layers.
        fully_shard(model, **kwargs, **({} if trainable else {"reshard_after_forward": True}))
    model.train(trainable)
    return model


def reshard(model: torch.nn.Module) -> None:
    """Free the gathered parameters of every FSDP group of `model`, the root's included: after a
    forward with no backward (log-probs) the root's stay gathered otherwise. A no-op for groups
    already sharded and for a model left whole."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()  # FSDPModule.reshard is not recursive


def pin_host_shards(model: torch.nn.Module, pin_memory: bool) -> int:
    """Page-lock, in place and at exactly their bytes, the host shards that FSDP streams a frozen
    model from (CPUOffloadPolicy); call it once they hold the weights (`fill_from_checkpoint`'s
    `to_empty` gives them new storage). Each storage is a parameter's dim-0-padded flat shard.
    Registered memory is pinned to torch (`Tensor.is_pinned`), so FSDP's `.to(device,
    non_blocking=True)` of a shard before its all-gather (FSDPParam.all_gather_inputs) is an
    asynchronous DMA, as from FSDP's own pinned copies. Returns the bytes locked (0 without a GPU:
    `page_locker` decides)."""
    from rlsys.actors.offload import page_lock, page_locker

    locker = page_locker(pin_memory)
    if locker is None:
        return 0
    locked: dict[int, int] = {}
    for param in model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        storage = local.untyped_storage()
        if local.device.type == "cpu" and storage.data_ptr() not in locked and storage.nbytes():
            page_lock(local, locker)
            locked[storage.data_ptr()] = storage.nbytes()
    return sum(locked.values())
