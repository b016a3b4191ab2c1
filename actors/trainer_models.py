"""What a trainer rank trains and scores with, built for its spec: the policy (sharded with FSDP2,
with LoRA's adapters when asked), the frozen reference when a KL term needs one, the optimizer and
its schedule, and what the rest of the rank reads off them (names as the engines and checkpoints
know them, MoE routes to replay, where a vision-language model's image features go)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from rlsys.actors.checkpoint_layout import checkpoint_pieces, released_names
from rlsys.actors.context_parallel import CONTEXT_PARALLEL
from rlsys.actors.cp_layout import ContextParallelGroup, check_ulysses_heads
from rlsys.actors.image_placement import ImagePlacement
from rlsys.actors.loading import build_empty_model, fill_from_checkpoint, is_vision_parameter
from rlsys.actors.logprob_head import install_logprob_head
from rlsys.actors.lora import adapters_disabled, add_adapters, checkpoint_name, initial_adapter, is_adapter_parameter
from rlsys.actors.parallelize import parallelize, pin_host_shards, uses_fsdp
from rlsys.actors.routing_replay import RouteReplay
from rlsys.actors.schedule import build_lr_scheduler
from rlsys.actors.trainer_spec import TrainerSpec
from rlsys.multimodal.vision_inputs import VisionInputs
from rlsys.system.backend import Backend


@dataclass
class TrainerModels:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    ref_model: torch.nn.Module | None  # None: no KL term, or LoRA (the reference is the policy, adapters off)
    released_name: Callable[[str], str]  # a parameter's name in the checkpoint and the engines
    # What the engine loads a stacked parameter (MoE experts) as: the sync sends those tensors.
    checkpoint_pieces: dict[str, list[tuple[str, tuple[int, ...]]]]
    vision: VisionInputs | None  # a vision-language model's image processor and token layout
    lora: bool  # the policy carries LoRA's adapters, the only parameters that train
    route_replays: dict[int, RouteReplay] = field(default_factory=dict)  # id(model) -> its routers' replay
    image_placements: dict[int, ImagePlacement] = field(default_factory=dict)  # id(model) -> its image features

    @contextmanager
    def reference(self) -> Iterator[torch.nn.Module]:
        """The reference policy of the KL terms: its own frozen model, or under LoRA the policy
        with its adapters off (the base model, no second copy)."""
        if self.ref_model is not None:
            yield self.ref_model
            return
        if not self.lora:
            raise RuntimeError("no reference model: the run has no KL term (algorithm.use_kl_loss, kl_in_reward)")
        with adapters_disabled(self.model) as base:
            yield base


def build_trainer_models(spec: TrainerSpec, backend: Backend, world_size: int,
                         context_parallel: ContextParallelGroup | None) -> TrainerModels:
    """The rank's models, optimizer and schedule for `spec`. Collective (the models are sharded)."""
    t = spec.trainer
    vision = VisionInputs.for_model(spec.model.path)
    model, released_name = _build_model(spec, backend, world_size, context_parallel, trainable=True,
                                        lora=spec.model.lora is not None)
    # fused: one kernel over all parameters (CPU and CUDA) instead of a dozen ops per parameter,
    # each of which goes through DTensor's Python dispatch: 27 -> 24 ms of a 0.3M model's step.
    optimizer = torch.optim.AdamW(  # the adapters only, under LoRA
        [p for p in model.parameters() if p.requires_grad], lr=t.lr, betas=tuple(t.betas),
        weight_decay=t.weight_decay, eps=1e-8, fused=True,
    )
    scheduler = build_lr_scheduler(optimizer, t.lr_schedule, t.warmup_steps, t.total_steps * t.mini_batches_per_step,
                                   t.min_lr_ratio)
    ref_model = None
    if spec.needs_reference and spec.model.lora is None:  # LoRA's reference: adapters off
        ref_model, _ = _build_model(spec, backend, world_size, context_parallel, trainable=False)
    models = TrainerModels(model, optimizer, scheduler, ref_model, released_name,
                           {name: [(piece.name, piece.shape) for piece in pieces]
                            for name, pieces in checkpoint_pieces(model).items()}, vision, spec.model.lora is not None)
    present = [m for m in (model, ref_model) if m is not None]
    if spec.routing_replay:
        models.route_replays = {id(m): RouteReplay(m) for m in present}
    if vision is not None:
        models.image_placements = {id(m): ImagePlacement(m) for m in present}
    return models


def trained_parameters(lora: bool, freeze_vision: bool) -> Callable[[str], bool] | None:
    """Which parameters learn (None: all): LoRA's adapters only, and none of a frozen vision tower's."""
    if not lora and not freeze_vision:
        return None
    return lambda name: (not lora or is_adapter_parameter(name)) and not (freeze_vision and is_vision_parameter(name))


def _build_model(spec: TrainerSpec, backend: Backend, world_size: int, context_parallel: ContextParallelGroup | None,
                 trainable: bool, lora: bool = False) -> tuple[torch.nn.Module, Callable[[str], str]]:
    """Built on the meta device, sharded, then each rank reads only its shards from the
    checkpoint (actors/loading.py): no rank ever holds the whole model, unless it trains alone
    in fp32 (`uses_fsdp`: then its shard is the whole model and FSDP has nothing to do).
    `lora`: with model.lora's adapters (actors/lora.py), the only parameters that train. Also
    the model's checkpoint and engine names, read off it before FSDP wraps it."""
    model = build_empty_model(spec.model.path, _attention(spec, backend, context_parallel))
    released = released_names(model)
    if lora:
        settings = spec.model.lora
        add_adapters(model, settings.rank, settings.alpha, settings.dropout, settings.target_modules)
    install_logprob_head(model)  # before sharding: it keeps lm_head's parameter and FSDP group
    mesh = None
    if uses_fsdp(world_size, spec.model.dtype, trainable):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(backend.device_type, (world_size,))
    model = parallelize(model, mesh, spec.model.dtype, trainable, spec.trainer.gradient_checkpointing,
                        trains=trained_parameters(lora, spec.model.freeze_vision),
                        on_host=not trainable and not spec.reference_on_device)
    # The frozen reference stays on the host unless the spec places it on the device: FSDP streams it
    # to the device layer by layer.
    on_host = not trainable and not spec.reference_on_device
    seed = spec.seed
    fill_from_checkpoint(model, spec.model.path, "cpu" if on_host else backend.device(), stored_as=checkpoint_name,
                         initial=(lambda name, shape: initial_adapter(name, shape, seed)
                                  if is_adapter_parameter(name) else None) if lora else None,
                         released=released)
    if on_host:
        pin_host_shards(model, backend.has_gpu)  # in place, at exactly their bytes
    return model, released


def _attention(spec: TrainerSpec, backend: Backend, context_parallel: ContextParallelGroup | None) -> str:
    """The attention implementation: the backend's, or with context parallelism the CP one."""
    if context_parallel is None:
        return backend.attn_implementation
    if context_parallel.style == "ulysses":
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(spec.model.path)
        check_ulysses_heads(config.num_attention_heads, config.num_key_value_heads, context_parallel.size)
    return CONTEXT_PARALLEL
