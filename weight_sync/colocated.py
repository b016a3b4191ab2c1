"""Colocated transport: hand weight buckets to an SGLang engine on the same node by IPC handle.

A bucket travels as its tensors' views into the staging buffer, pickled with torch's
multiprocessing reductions: a CUDA IPC handle for GPU memory, a shared-memory file name for host
memory (`Backend.prepare_ipc`), plus each view's offset and shape. The engine maps the same memory
instead of receiving bytes and loads it with `weight_sync.engine_loader` (why not SGLang's own
`flattened_bucket` loader: see that module). The handle must stay alive until the engine has
loaded it: `/update_weights_from_tensor` answers only after the load (the loader waits for its
device copies), and only then is the buffer gathered into again.

Pickling shares the memory. Each pickle of a CUDA tensor puts its storage behind a new counter
set to 1 (torch/csrc/StorageSharing.cpp `THPStorage_shareCuda`, CudaIPCTypes.cpp
`GetNewRefCountedSentData`); the receiver takes it back to 0 when it unpickles a block it already
maps (reductions.py `rebuild_cuda_tensor`: `_release_ipc_counter`) or frees the tensor it mapped
(the deleter of `THPStorage_newSharedCuda`). The sender's storage, once dropped, waits in torch's
"limbo" while its counter is above 0 (`CudaIPCSentDataDelete`), and only `torch.cuda.ipc_collect`
frees it after that. Each pickle of a shared-memory tensor likewise takes a reference on its file
(reductions.py `reduce_storage`: `_shared_incref`) that `rebuild_storage_filename` returns. A
payload pickled and never opened therefore pins its buffer for the life of the trainer process.
So a bucket is pickled only as it is handed to the engine, never while it waits in the queue: a
hand-over skipped after a failure shares nothing. (A payload sent to an engine that dies before
opening it still pins its buffer: only the receiver can return the reference, and the sender
cannot tell whether it did.)

A CUDA payload names its device by the GPU's UUID, not by the trainer's index of it (which the
engine's process, with its own CUDA_VISIBLE_DEVICES and one GPU per TP rank, may not share):
SGLang's receiver maps the UUID back to its own index (`serialize_named_tensors`).
"""

from __future__ import annotations

import base64
import gc
import io
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.reduction import ForkingPickler
from typing import Any, Protocol

import torch
import torch.multiprocessing  # noqa: F401 - registers torch's tensor reductions with ForkingPickler
from torch.multiprocessing import reductions

from rlsys.weight_sync.buckets import WeightBucket
from rlsys.weight_sync.call_queue import EngineCallQueue
from rlsys.weight_sync.engine_loader import END_OF_SYNC, LOAD_FORMAT

COLOCATED_ALIGNMENT = 16  # bytes: every tensor's view in a bucket starts aligned for its dtype
# Position of the device in the arguments torch's `reduce_tensor` gives `rebuild_cuda_tensor`
# (`storage_device`); SGLang's receiver reads the same slot (patch_torch._REDUCE_TENSOR_ARG_DEVICE_INDEX).
DEVICE_ARG_INDEX = 6


class TensorUpdateEndpoints(Protocol):
    """The engine endpoints this transport needs (`rlsys.rollout.sglang.client.SGLangClient` has them)."""

    def begin_weight_update(self) -> None: ...
    def update_weights_from_tensor(self, serialized_named_tensors: list[str], load_format: str,
                                   flush_cache: bool = False, weight_version: str | None = None) -> None: ...
    def end_weight_update(self) -> None: ...


class StagingBuffer:
    """One reusable bucket-sized buffer: every bucket of every sync is gathered into it.

    Reuse keeps the extra memory at one bucket and avoids the first-touch page faults of fresh
    memory (several times slower than warm copies); the engine maps the same pages each time.
    CPU buffers live in shared memory so they travel as handles (the twin of CUDA IPC)."""

    def __init__(self, share_memory: bool):
        self.share_memory = share_memory
        self._buffer: torch.Tensor | None = None

    def get(self, nbytes: int, device: torch.device) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < nbytes or self._buffer.device != device:
            self._buffer = None
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
            if self.share_memory and device.type == "cpu":
                buffer.share_memory_()
            self._buffer = buffer
        return self._buffer

    @property
    def nbytes(self) -> int:
        """What the buffer holds now (0 once released)."""
        return 0 if self._buffer is None else self._buffer.numel()

    def release(self) -> None:
        self._buffer = None


class StagingSlots:
    """A transport's two staging buffers, which a pipelined sync's buckets take in turn
    (weight_sync/sync.py; a serial sync uses slot 0 only)."""

    def __init__(self, share_memory: bool):
        self._buffers = (StagingBuffer(share_memory), StagingBuffer(share_memory))

    def get(self, slot: int, nbytes: int, device: torch.device) -> torch.Tensor:
        return self._buffers[slot].get(nbytes, device)

    @property
    def nbytes(self) -> int:
        return sum(buffer.nbytes for buffer in self._buffers)

    def release(self) -> None:
        for buffer in self._buffers:
            buffer.release()


def serialize_named_tensors(named_tensors: list[tuple[str, torch.Tensor]]) -> str:
    """A base64 payload of (name, tensor) pairs as IPC handles and offsets, ~100 bytes per tensor
    whatever its size. Views of one storage (a bucket) share a handle the receiver opens once.
    Shares the tensors' memory until the receiver opens the payload (see the module's docstring).
    A CUDA tensor's device travels as its GPU's UUID (`with_device_uuid`); host tensors travel as
    torch's reductions make them."""
    buffer = io.BytesIO()
    _EnginePickler(buffer).dump(named_tensors)
    return base64.b64encode(buffer.getvalue()).decode()


def cuda_device_uuid(index: int) -> str:
    """A GPU's UUID, spelled as SGLang's receiver compares it: `str(torch.cuda.get_device_properties(i)
    .uuid)` (sglang/srt/utils/patch_torch.py, `_device_to_uuid` and `_device_from_maybe_uuid`)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def with_device_uuid(reduced: tuple[Callable, tuple], device_uuid: Callable[[int], str] = cuda_device_uuid,
                     ) -> tuple[Callable, tuple]:
    """torch's reduction of a CUDA tensor, `(rebuild_cuda_tensor, args)`, with the device index in
    `args[DEVICE_ARG_INDEX]` replaced by that GPU's UUID.

    The index is the sender's; the engine's process numbers its GPUs by its own CUDA_VISIBLE_DEVICES
    (and a TP engine's ranks each sit on another GPU). SGLang patches torch's `rebuild_cuda_tensor`
    in the engine (patch_torch.monkey_patch_torch_reductions, called by
    tp_worker.deserialize_own_rank before it unpickles) so that a string in this slot is looked up
    among its own GPUs' UUIDs (`_device_from_maybe_uuid`). The callable stays torch's own
    `rebuild_cuda_tensor`: SGLang's SafeUnpickler admits no other."""
    rebuild, args = reduced
    device = args[DEVICE_ARG_INDEX]
    if isinstance(device, str):  # already a UUID (a process where SGLang patched torch's reductions)
        return reduced
    if isinstance(device, bool) or not isinstance(device, int):
        raise TypeError(f"torch's CUDA tensor reduction no longer has the device index at argument "
                        f"{DEVICE_ARG_INDEX} (found {device!r}); update DEVICE_ARG_INDEX with SGLang's "
                        "patch_torch._REDUCE_TENSOR_ARG_DEVICE_INDEX")
    return rebuild, (*args[:DEVICE_ARG_INDEX], device_uuid(device), *args[DEVICE_ARG_INDEX + 1:])


class _EnginePickler(ForkingPickler):
    """torch's multiprocessing reductions (registered with ForkingPickler), with CUDA tensors' devices
    named by UUID. Looks `reduce_tensor` up at each call, as ForkingPickler's table would."""

    def reducer_override(self, obj: Any):
        if isinstance(obj, torch.Tensor) and obj.is_cuda:
            return with_device_uuid(reductions.reduce_tensor(obj))
        return NotImplemented


class ColocatedWeightSender:
    """A trainer rank's transport to the engine on its node.

    Its engine calls run in order on a thread of their own (`EngineCallQueue`): `begin`,
    `send_bucket` and `end` queue a call and return its future, so the sync gathers the next
    bucket while the engine loads this one. Two staging buffers (slots) take turns: a slot is
    gathered into again only once the engine has loaded the bucket it held."""

    alignment = COLOCATED_ALIGNMENT

    def __init__(self, engine: TensorUpdateEndpoints, tp_size: int = 1):
        self.engine = engine
        self.tp_size = tp_size
        self._staging = StagingSlots(share_memory=True)
        self._queue = EngineCallQueue("rlsys-colocated-sync")
        self._engine_maps_staging = False  # the engine's loader still holds a staging buffer (queue thread only)
        self._sync_failed = False  # the last sync's session closed after a failure

    def staging_buffer(self, slot: int, nbytes: int, device: torch.device) -> torch.Tensor:
        return self._staging.get(slot, nbytes, device)

    @property
    def staging_nbytes(self) -> int:
        return self._staging.nbytes

    def release_staging_buffer(self) -> None:
        """Drop the buffers between syncs (the next sync allocates them again). The engine's loader
        has let go of them with the sync's last bucket (`END_OF_SYNC`), or with the empty bucket
        that closes a failed sync.

        After a failed sync its error holds views of the buffers: its traceback keeps the frames of
        the failed and the skipped hand-overs and of `sync_weights`, which holds the error in turn (a
        reference cycle). Collect it, so that the buffers are freed now, where the trainer's sleep
        then returns them to the device (`Backend.empty_device_cache`: `torch.cuda.ipc_collect`
        frees a CUDA block the engine mapped once the engine has let go of it), not whenever
        Python's collector next runs."""
        self._staging.release()
        if self._sync_failed:
            self._sync_failed = False
            gc.collect()

    def close(self) -> None:
        self._queue.close()
        self.release_staging_buffer()

    def begin(self) -> Future:
        self._queue.reset()
        return self._queue.submit(self.engine.begin_weight_update)

    def send_bucket(self, bucket: WeightBucket, flush_cache: bool, weight_version: str | None) -> Future:
        """Queues the bucket's hand-over; its future completes once the engine has loaded it, so
        the handle (and the slot) may then be reused. `flush_cache` marks the sync's last bucket:
        it also tells the engine's loader to let go of the staging buffers' mappings once loaded
        (`END_OF_SYNC`, an empty view of the buffer)."""
        tensors = bucket.tensors() + ([(END_OF_SYNC, bucket.buffer[:0])] if flush_cache else [])

        def hand_over():
            # Pickled here, not when queued: pickling shares the buffer until the engine opens the
            # payload, and a hand-over skipped after a failure never reaches the engine. One payload
            # per TP rank: each rank maps the same full tensors and keeps its shard, and each
            # unpickling returns the reference of one pickle.
            payloads = [serialize_named_tensors(tensors) for _ in range(self.tp_size)]
            self._engine_maps_staging = True
            self.engine.update_weights_from_tensor(payloads, LOAD_FORMAT, flush_cache, weight_version)
            self._engine_maps_staging = not flush_cache

        return self._queue.submit(hand_over)

    def end(self) -> Future:
        def close_session():
            # The queue lets go of the sync's error: its traceback's frames hold the buckets' views.
            if self._queue.take_failure() is not None:
                self._sync_failed = True
            if self._engine_maps_staging:  # the sync failed before its last bucket was loaded
                self.engine.update_weights_from_tensor([serialize_named_tensors([])] * self.tp_size, LOAD_FORMAT)
                self._engine_maps_staging = False
            self.engine.end_weight_update()

        return self._queue.submit(close_session, always=True)
