"""Build a model without its weights, shard it, then fill each rank's shards from the checkpoint.

A rank never holds the whole model: the module tree is built with its parameters on the meta
device (buffers such as rotary tables are computed for real: they are small and not in the
checkpoint), `fully_shard` lays the meta parameters out, and each rank reads from the safetensors
files only the rows of each tensor that its shard holds (safetensors slices are memory-mapped
reads). A rank's peak during load is its shard plus one tensor's slice, not the model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch

from rlsys.actors.checkpoint_layout import Piece, checkpoint_pieces, released_names
from rlsys.actors.context_parallel import CONTEXT_PARALLEL, register_context_parallel_attention
from rlsys.actors.packed_attention import PACKED_SDPA, register_packed_sdpa
from rlsys.actors.varlen_attention import PACKED_VARLEN, register_packed_varlen

SAFETENSORS_INDEX = "model.safetensors.index.json"


@contextmanager
def parameters_on_meta():
    """Modules built inside get their parameters on the meta device (each is created, then moved:
    one tensor at a time exists for real) and their buffers computed as usual."""
    register = torch.nn.Module.register_parameter

    def register_on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def is_vision_language(config) -> bool:
    """A vision-language model's config (Qwen2.5-VL's): a vision tower's config beside the text model's."""
    return getattr(config, "vision_config", None) is not None


# Where transformers 5 puts a vision-language model's vision tower (and its merger) in the module tree.
VISION_TOWER_PREFIX = "model.visual."


def is_vision_parameter(name: str) -> bool:
    """A parameter of the vision tower (model.freeze_vision keeps these as loaded)."""
    return name.startswith(VISION_TOWER_PREFIX)


def build_empty_model(path: str, attn_implementation: str) -> torch.nn.Module:
    """The model of `path`/config.json with fp32 parameters on the meta device: a causal LM, or a
    vision-language model (its vision tower and language model, transformers' image-text-to-text class)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    if attn_implementation == PACKED_SDPA:
        register_packed_sdpa()
    if attn_implementation == PACKED_VARLEN:
        register_packed_varlen()
    if attn_implementation == CONTEXT_PARALLEL:
        register_context_parallel_attention()
    config = AutoConfig.from_pretrained(path)
    model_class = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
    with parameters_on_meta():
        model = model_class.from_config(config, dtype=torch.float32, attn_implementation=attn_implementation)
    model.config.use_cache = False
    return model


class CheckpointFiles:
    """Which safetensors file holds each tensor of a Hugging Face checkpoint directory."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / SAFETENSORS_INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.file_of = {name: self.path / file for name, file in weight_map.items()}
        else:
            from safetensors import safe_open

            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{self.path} holds no *.safetensors weight files")
            self.file_of = {}
            for file in files:
                with safe_open(str(file), framework="pt") as handle:
                    self.file_of.update({name: file for name in handle.keys()})  # noqa: SIM118 - not a dict

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of tensor `name` (all of a 0-d tensor), reading only those bytes."""
        from safetensors import safe_open

        with safe_open(str(self.file_of[name]), framework="pt") as handle:
            rows = handle.get_slice(name)
            return rows[:] if len(rows.get_shape()) == 0 else rows[start:stop]


def parameters_without_tensor(path: str | Path) -> list[str]:
    """Parameters of the model `path`/config.json builds (on the meta device: no memory) that the
    checkpoint has no tensor for under any of their names (for a stacked parameter: one of its
    pieces); what `fill_from_checkpoint` would stop at."""
    model = build_empty_model(str(path), "sdpa")
    stored = CheckpointFiles(path).file_of
    stacked = checkpoint_pieces(model)
    released = released_names(model)
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(released(name))
    return [names[0] for names in aliases.values()
            if not (all(piece.name in stored for piece in stacked[names[0]]) if names[0] in stacked
                    else any(name in stored for name in names))]


def _read_stacked(param: torch.Tensor, pieces: list[Piece], files: CheckpointFiles, path: str | Path) -> int:
    """This rank's rows (whole experts: FSDP shards dim 0) of a stacked parameter, each row the
    concatenation of its pieces as the checkpoint stores them (actors/checkpoint_layout.py)."""
    local, first_row = _local_rows(param)
    per_row = len(pieces) // param.shape[0]
    read = 0
    for row in range(local.shape[0]):
        parts = []
        for piece in pieces[(first_row + row) * per_row:(first_row + row + 1) * per_row]:
            if piece.name not in files.file_of:
                raise KeyError(f"the checkpoint in {path} has no tensor {piece.name} (part of the stacked "
                               f"parameter of shape {tuple(param.shape)})")
            tensor = files.read_rows(piece.name, 0, piece.shape[0])
            if tuple(tensor.shape) != piece.shape:
                raise ValueError(f"checkpoint tensor {piece.name}: shape {tuple(tensor.shape)}, expected {piece.shape} "
                                 "(config.json and weights disagree?)")
            parts.append(tensor)
            read += tensor.numel() * tensor.element_size()
        local[row].copy_(torch.cat(parts) if len(parts) > 1 else parts[0])
    return read


def _local_rows(param: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(this rank's local tensor, its first row in the full tensor). FSDP2 shards dim 0 in
    `torch.chunk` pieces: rank r holds rows [r * ceil(n / W), ...)."""
    if not hasattr(param, "to_local"):
        return param, 0
    from torch.distributed.tensor import Shard

    mesh, placements = param.device_mesh, param.placements
    if mesh.ndim != 1 or placements != (Shard(0),):
        raise ValueError(f"cannot load a parameter laid out as {placements} on a {mesh.ndim}-D mesh")
    chunk = math.ceil(param.shape[0] / mesh.size())
    return param.to_local(), mesh.get_local_rank() * chunk


def _retie(model: torch.nn.Module, tied_names: list[list[str]]) -> None:
    """`to_empty` gives an unsharded module's tied parameters separate storage (FSDP keeps them
    shared); point every name of a tied group at its first parameter again."""
    for names in tied_names:
        shared = model.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(owner), attribute, shared)


def fill_from_checkpoint(model: torch.nn.Module, path: str | Path, device: torch.device | str,
                         stored_as: Callable[[str], str] = str,
                         initial: Callable[[str, torch.Size], torch.Tensor | None] | None = None,
                         released: Callable[[str], str] | None = None) -> int:
    """Give the meta-device (possibly sharded) `model` storage on `device` and read each local
    shard from the checkpoint at `path`; buffers keep their computed values. Returns the bytes read.
    `stored_as`: a parameter's name in the checkpoint (LoRA's `base_layer` dropped, actors/lora.py),
    then renamed as the released checkpoint names it (`released_names`: a vision-language model's);
    `initial`: the full value of a parameter the checkpoint does not hold (None for the others).
    `released`: `released_names` of the model as built, before FSDP wrapped it (transformers finds no
    renamings for FSDP's subclass, which it takes for custom code); None: of `model` itself."""
    buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    aliases: dict[int, list[str]] = {}  # tied weights: one parameter, several names
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    model.to_empty(device=device)
    _retie(model, [names for names in aliases.values() if len(names) > 1])
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])
    files = CheckpointFiles(path)
    aliases = {id(model.get_parameter(names[0])): names for names in aliases.values()}
    stacked = checkpoint_pieces(model)
    released = released or released_names(model)

    def stored_name(name: str) -> str:
        return released(stored_as(name))
    read = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in stacked:
                read += _read_stacked(param, stacked[name], files, path)
                continue
            value = initial(name, param.shape) if initial is not None else None
            if value is not None:
                local, first_row = _local_rows(param)
                local.copy_(value[first_row:first_row + local.shape[0]])
                continue
            stored = next((stored_name(alias) for alias in aliases[id(param)] if stored_name(alias) in files.file_of),
                          None)
            if stored is None:
                raise KeyError(f"the checkpoint in {path} has no tensor for parameter {name} "
                               f"(looked for {aliases[id(param)]})")
            local, first_row = _local_rows(param)
            if local.numel() == 0:
                continue
            rows = files.read_rows(stored, first_row, first_row + (local.shape[0] if local.ndim else 0))
            if rows.shape != local.shape:
                raise ValueError(f"checkpoint tensor {stored}: rows {tuple(rows.shape)} do not fit the shard "
                                 f"{tuple(local.shape)} of {name} (config.json and weights disagree?)")
            local.copy_(rows)
            read += rows.numel() * rows.element_size()
    return read
