"""sleep / wake_up: move a trainer's device state to host memory and back, in place.

Each distinct storage behind the sharded parameters, their gradients and the optimizer state is
copied into one host arena (a view per storage, each at a 64-byte boundary) and then resized to
zero bytes, which frees the device memory while every tensor object, and so FSDP's and the
optimizer's references to it, stays valid. `wake_up` resizes the storages back and copies the
bytes in.

On a GPU host the arena is page-locked and kept across cycles: it holds exactly the bytes moved
(rounded up to 64 per storage), which the memory plan counts, and pinning is paid once. It is not
taken from torch's caching host allocator (`pin_memory=True`), which rounds every block up to a
power of two and keeps it: ~1.9x the bytes moved. On a CPU-only host (the host is the device) the
same state machine runs with an arena that is freed at wake_up, so the path is exercised and
verified and nothing is held twice.
"""

from __future__ import annotations

import ctypes
import time
import weakref
from dataclasses import dataclass, field
from typing import Protocol

import torch

# Where each storage's copy starts in the arena: a cache line, a multiple of every dtype's size.
ALIGNMENT = 64


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def trainer_state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Local shards of parameters, gradients and optimizer-state tensors."""
    tensors = []
    for param in model.parameters():
        tensors.append(_local(param))
        if param.grad is not None:
            tensors.append(_local(param.grad))
    if optimizer is not None:
        for state in optimizer.state.values():
            tensors.extend(_local(v) for v in state.values() if isinstance(v, torch.Tensor))
    return tensors


def state_bytes_after_a_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The arena a sleep after an optimizer step takes, computable before the first step (when
    AdamW has no state yet): every distinct storage of the parameters' local shards (FSDP's padded
    ones), and for each trained parameter AdamW's two moments (new tensors of the shard's bytes)
    and its step (a 4-byte tensor), each copy rounded up to ALIGNMENT; no gradients (train_step
    ends with zero_grad(set_to_none=True)). Optimizer state that exists already counts as it is."""
    sizes, seen = [], set()
    for param in model.parameters():
        storage = _local(param).untyped_storage()
        if storage.data_ptr() not in seen and storage.nbytes():
            seen.add(storage.data_ptr())
            sizes.append(storage.nbytes())
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            if state:
                sizes.extend(_local(v).untyped_storage().nbytes() for v in state.values()
                             if isinstance(v, torch.Tensor))
            else:
                local = _local(param)
                sizes.extend([local.numel() * local.element_size()] * 2 + [4])  # exp_avg, exp_avg_sq, step
    return arena_layout(sizes)[1]


def aligned(nbytes: int, alignment: int = ALIGNMENT) -> int:
    return -(-nbytes // alignment) * alignment


def arena_layout(sizes: list[int], alignment: int = ALIGNMENT) -> tuple[list[int], int]:
    """(offset of each copy, the arena's bytes): copies packed in order, each starting on an
    `alignment` boundary; the arena is sum(round_up(size, alignment)), never a power of two."""
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += aligned(size, alignment)
    return offsets, end


class PageLocker(Protocol):
    """Page-locks host memory in place (pinned: the device copies it by DMA, asynchronously)."""

    def lock(self, ptr: int, nbytes: int) -> None: ...

    def unlock(self, ptr: int) -> None: ...


class CudaHostRegister:
    """cudaHostRegister / cudaHostUnregister through torch's CUDA runtime bindings
    (`torch.cuda.cudart()`, torch._C._cudart), as torch's own checkpoint stager pins the buffers it
    allocates (torch/cuda/_pin_memory_utils.py, used by torch/distributed/checkpoint/
    _state_dict_stager.py). Registered memory is pinned for torch: `Tensor.is_pinned()` asks
    CUDAHooks::isPinnedPtr (aten/src/ATen/cuda/detail/CUDAHooks.cpp), which is
    cudaPointerGetAttributes(...).type == cudaMemoryTypeHost, true of registered pages. Flag 0 is
    cudaHostRegisterDefault (with unified addressing, portable and mapped as well)."""

    def lock(self, ptr: int, nbytes: int) -> None:
        _check(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0), "cudaHostRegister", nbytes)

    def unlock(self, ptr: int) -> None:
        _check(torch.cuda.cudart().cudaHostUnregister(ptr), "cudaHostUnregister")


def _check(error, call: str, nbytes: int | None = None) -> None:
    if int(error) != 0:
        size = f" of {nbytes / 2**30:.2f} GiB" if nbytes is not None else ""
        reason = torch.cuda.cudart().cudaGetErrorString(error)
        raise RuntimeError(f"{call}{size} failed: {reason} (cudaError {int(error)}); page-locked memory is "
                           "limited by the host's RAM and the container's memory limit (rlsys plan: host memory)")


def page_locker(pin_memory: bool) -> PageLocker | None:
    """The one place that decides how host copies are page-locked: on a GPU host by registering
    memory allocated as ordinary CPU tensors (exactly their bytes), never through torch's caching
    host allocator; on a CPU-only host not at all."""
    return CudaHostRegister() if pin_memory else None


def page_lock(tensor: torch.Tensor, locker: PageLocker) -> weakref.finalize | None:
    """Page-lock `tensor`'s whole storage in place until the storage is freed, when it is
    unregistered first (weakref.finalize on the storage, whose Python object lives as long as the
    storage does, as torch/distributed/checkpoint/_state_dict_stager.py does). Returns the
    finalizer, which unregisters it at once when called; None for an empty storage."""
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0:
        return None
    locker.lock(storage.data_ptr(), storage.nbytes())
    unlock = weakref.finalize(storage, locker.unlock, storage.data_ptr())
    unlock.atexit = False  # at exit the process's memory goes, registrations with it (CUDA may be torn down)
    return unlock


@dataclass
class HostArena:
    """One host buffer of uint8, page-locked by `locker` when there is one."""

    buffer: torch.Tensor
    _unlock: weakref.finalize | None = None

    @classmethod
    def allocate(cls, nbytes: int, locker: PageLocker | None) -> HostArena:
        buffer = torch.empty(nbytes, dtype=torch.uint8, device="cpu")
        return cls(buffer, page_lock(buffer, locker) if locker is not None else None)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def release(self) -> None:
        """Unregister (before the memory goes back to the allocator), then free."""
        if self._unlock is not None:
            self._unlock()
        self.buffer = torch.empty(0, dtype=torch.uint8)


@dataclass
class OffloadReport:
    bytes: int  # moved between device and host
    seconds: float
    held_bytes: int | None = None  # what the rank holds on its device afterwards (set by the trainer)
    host_bytes: int = 0  # host memory the offloader holds afterwards (its arena; page-locked on GPU hosts)


@dataclass
class StateOffloader:
    pin_memory: bool
    # Keep the arena across cycles (default: on GPU hosts, where it is page-locked and pinning is costly).
    keep_arena: bool | None = None
    locker: PageLocker | None = None  # default: page_locker(pin_memory)
    _arena: HostArena | None = None
    _backups: list[tuple[torch.UntypedStorage, torch.Tensor]] = field(default_factory=list)

    def __post_init__(self):
        if self.keep_arena is None:
            self.keep_arena = self.pin_memory
        if self.locker is None:
            self.locker = page_locker(self.pin_memory)

    @property
    def asleep(self) -> bool:
        return bool(self._backups)

    @property
    def host_bytes(self) -> int:
        return self._arena.nbytes if self._arena is not None else 0

    def prepare(self, nbytes: int) -> float:
        """Allocate (and page-lock) the kept arena now, off the step's path: on a GPU host the first
        sleep otherwise pays for paging in and registering the whole state (10-15 s for a 1.5B
        model's 18 GB, measured on an H200). Nothing to do without a kept arena (a CPU host copies
        into fresh memory each time and frees it at wake_up). Returns the seconds it took."""
        if not self.keep_arena or nbytes == 0:
            return 0.0
        start = time.perf_counter()
        self._arena_for(nbytes)  # page-locking maps every page of it now
        return time.perf_counter() - start

    def sleep(self, tensors: list[torch.Tensor]) -> OffloadReport:
        if self.asleep:
            raise RuntimeError("sleep() called twice without wake_up()")
        start = time.perf_counter()
        storages, seen = [], set()
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                continue
            seen.add(storage.data_ptr())
            storages.append(storage)
        offsets, total = arena_layout([storage.nbytes() for storage in storages])
        arena = self._arena_for(total)
        moved = 0
        for storage, offset in zip(storages, offsets, strict=True):
            backup = arena.buffer[offset:offset + storage.nbytes()]
            backup.copy_(_byte_view(storage))
            storage.resize_(0)
            self._backups.append((storage, backup))
            moved += backup.numel()
        _return_freed_host_memory()
        return OffloadReport(moved, time.perf_counter() - start, host_bytes=self.host_bytes)

    def wake_up(self) -> OffloadReport:
        start = time.perf_counter()
        moved = self._restore()  # returns holding no view: one would keep the arena alive past its release
        if not self.keep_arena:
            self.release()
        return OffloadReport(moved, time.perf_counter() - start, host_bytes=self.host_bytes)

    def _restore(self) -> int:
        moved = 0
        for storage, backup in self._backups:
            storage.resize_(backup.numel())
            _byte_view(storage).copy_(backup)
            moved += backup.numel()
        self._backups = []
        return moved

    def release(self) -> None:
        """Give the arena back (unregistered first); only while awake."""
        if self.asleep:
            raise RuntimeError("release() while asleep would drop the only copy of the state")
        if self._arena is not None:
            self._arena.release()
            self._arena = None
            _return_freed_host_memory()

    def _arena_for(self, nbytes: int) -> HostArena:
        """The kept arena when it holds `nbytes`; else a new one of exactly `nbytes` (the state
        grew: the optimizer's moments appear at the first step), the old one freed first."""
        if self._arena is None or self._arena.nbytes < nbytes:
            self.release()
            self._arena = HostArena.allocate(nbytes, self.locker)
        return self._arena


def _return_freed_host_memory() -> None:
    # glibc keeps freed blocks of these sizes in its heap and raises its mmap threshold after
    # each large free, so without a trim every cycle's host copies add to the RSS for good.
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
