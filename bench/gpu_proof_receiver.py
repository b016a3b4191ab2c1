"""The engine side of the GPU proof kit's colocated sync: a second process on the same device that
takes weight buckets the way an SGLang 0.5.23 server does, without SGLang.

What it reproduces, from SGLang's source (sglang/srt/utils/common.py, patch_torch.py):
- a payload is base64 text of a ForkingPickler pickle, opened with SGLang's `SafeUnpickler`, whose
  allowlist admits builtins' containers, torch's dtypes, sizes and storages and the rebuild functions
  of torch.multiprocessing.reductions, and nothing else (`SAFE_GLOBALS` below: the part of that
  allowlist a tensor payload can touch);
- SGLang patches torch's `rebuild_cuda_tensor` (monkey_patch_torch_reductions) so that the device
  slot of a CUDA tensor's reduce arguments (index 6) may hold the GPU's UUID, which it maps back to
  this process's own index of that GPU;
- the server calls the custom loader named by `load_format` (`rlsys.weight_sync.engine_loader
  .load_bucket`) with its model and the named tensors; the model's `load_weights` copies each one
  into its parameter.
The model here is transformers' own (the names the trainer sends are transformers' names).
"""

from __future__ import annotations

import base64
import importlib
import importlib.util
import io
import pickle
import sys
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def import_rlsys_from_checkout() -> None:
    """Make `rlsys.*` importable from this checkout whether or not it is installed. pyproject maps the
    top-level actors/, rollout/ and weight_sync/ folders to rlsys.actors, ...: adding the checkout's
    root to the rlsys package's path does the same without an install (the GPU machine's Python
    3.12 is outside pyproject's range, and the machine has no network)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import rlsys

    if importlib.util.find_spec("rlsys.actors") is None:
        rlsys.__path__.append(str(REPO))

# The device slot of torch.multiprocessing.reductions.reduce_tensor's CUDA arguments (SGLang's
# patch_torch._REDUCE_TENSOR_ARG_DEVICE_INDEX).
DEVICE_ARG_INDEX = 6

_BUILTIN_TYPES = {"bool", "bytearray", "bytes", "dict", "float", "frozenset", "int", "list", "set", "slice", "str",
                  "tuple"}
_REBUILD_FUNCTIONS = {"rebuild_tensor", "rebuild_cuda_tensor", "rebuild_storage_fd", "rebuild_storage_filename",
                      "rebuild_storage_empty", "rebuild_typed_storage", "rebuild_typed_storage_child",
                      "rebuild_meta_tensor"}
_TORCH_NAMES = {"Size", "device", "UntypedStorage", "Tensor"}
_TORCH_UTILS = {"_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter"}


def is_safe_global(module: str, name: str) -> bool:
    """SGLang's SafeUnpickler allowlist, as far as a tensor payload reaches."""
    if module == "builtins":
        return name in _BUILTIN_TYPES
    if module == "torch":
        return name in _TORCH_NAMES or isinstance(getattr(torch, name, None), torch.dtype)
    if module == "torch.storage":
        return name in ("UntypedStorage", "TypedStorage")
    if module == "torch._utils":
        return name in _TORCH_UTILS
    if module == "torch.multiprocessing.reductions":
        return name in _REBUILD_FUNCTIONS
    return (module, name) in {("copyreg", "__newobj__"), ("collections", "OrderedDict")}


class SafeUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if is_safe_global(module, name):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")


def device_from_maybe_uuid(device: int | str) -> int:
    """SGLang's patch_torch._device_from_maybe_uuid: a CUDA device index, or a GPU UUID mapped to this
    process's index of that GPU."""
    if isinstance(device, int):
        return device
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == device:
            return index
    raise RuntimeError(f"Invalid device_uuid={device}")


def patch_cuda_rebuild() -> None:
    """What SGLang's monkey_patch_torch_reductions does to the receiving side."""
    from torch.multiprocessing import reductions

    if hasattr(reductions, "_rlsys_rebuild_cuda_tensor_original"):
        return
    original = reductions.rebuild_cuda_tensor
    reductions._rlsys_rebuild_cuda_tensor_original = original

    def rebuild_cuda_tensor(*args):
        args = (*args[:DEVICE_ARG_INDEX], device_from_maybe_uuid(args[DEVICE_ARG_INDEX]), *args[DEVICE_ARG_INDEX + 1:])
        return original(*args)

    reductions.rebuild_cuda_tensor = rebuild_cuda_tensor
    reductions.init_reductions()


def deserialize(payload: str):
    return SafeUnpickler(io.BytesIO(base64.b64decode(payload, validate=True))).load()


def load_weights(model: torch.nn.Module, weights) -> None:
    """A model's `load_weights` as SGLang's default loader does it: copy each tensor into its parameter."""
    params = dict(model.named_parameters())
    for name, tensor in weights:
        if name not in params and name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue  # tied: the embedding already took these values
        if name not in params:
            raise KeyError(f"the engine's model has no parameter {name}")
        params[name].data.copy_(tensor)


def fingerprint(tensor: torch.Tensor) -> tuple[int, int]:
    """Two integers of a tensor's exact bits: their sum and a position-weighted sum. Any change of
    one element changes the first; reordered elements change the second."""
    bits = tensor.detach().contiguous().reshape(-1)
    bits = bits.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[bits.element_size()]).long()
    weights = torch.arange(bits.numel(), device=bits.device, dtype=torch.long) % 65521 + 1
    return int(bits.sum()), int((bits * weights).sum())


def model_fingerprints(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    return {name: fingerprint(param) for name, param in model.named_parameters()}


def serve(connection, model_dir: str, device: str, dtype: str) -> None:
    """The receiver's loop: one request per message, answered with ("ok", result) or ("error", text)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    patch_cuda_rebuild()
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=getattr(torch, dtype))
    model.load_weights = lambda weights: load_weights(model, weights)
    connection.send(("ok", "ready"))
    while True:
        request, *args = connection.recv()
        try:
            if request == "exit":
                connection.send(("ok", None))
                return
            if request == "update":
                payloads, load_format = args
                module, _, function = load_format.rpartition(".")
                loader = getattr(importlib.import_module(module), function)
                for payload in payloads:  # one per TP rank: this engine has one
                    named_tensors = deserialize(payload)
                    loader(model, named_tensors)
                    del named_tensors  # drop the mapped staging memory before answering
                result = None
            elif request == "fingerprints":
                result = model_fingerprints(model)
            elif request == "allocated":
                result = torch.cuda.memory_allocated() if device.startswith("cuda") else 0
            else:
                raise ValueError(f"unknown request {request!r}")
            connection.send(("ok", result))
        except Exception:  # noqa: BLE001 - reported to the kit, which names the check that failed
            connection.send(("error", traceback.format_exc()[-3000:]))
