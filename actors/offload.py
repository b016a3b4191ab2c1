"""sleep / wake_up: move a trainer's device state to host memory and back, in place.

Each distinct storage behind the sharded parameters, their gradients and the optimizer state is
copied to a host backup (pinned on GPU hosts) and then resized to zero bytes, which frees the
device memory while every tensor object, and so FSDP's and the optimizer's references to it,
stays valid. `wake_up` resizes the storages back and copies the bytes in. On a CPU-only host the
same state machine runs with a separate host backup, so the path is exercised and verified.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass, field

import torch


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


@dataclass
class OffloadReport:
    bytes: int
    seconds: float
    held_bytes: int | None = None  # what the rank holds on its device afterwards (set by the trainer)


@dataclass
class StateOffloader:
    pin_memory: bool
    _backups: list[tuple[torch.UntypedStorage, torch.Tensor]] = field(default_factory=list)

    @property
    def asleep(self) -> bool:
        return bool(self._backups)

    def sleep(self, tensors: list[torch.Tensor]) -> OffloadReport:
        if self.asleep:
            raise RuntimeError("sleep() called twice without wake_up()")
        start = time.perf_counter()
        seen, moved = set(), 0
        for tensor in tensors:
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key in seen or storage.nbytes() == 0:
                continue
            seen.add(key)
            backup = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu", pin_memory=self.pin_memory)
            backup.copy_(_byte_view(storage))
            storage.resize_(0)
            self._backups.append((storage, backup))
            moved += backup.numel()
        _return_freed_host_memory()
        return OffloadReport(moved, time.perf_counter() - start)

    def wake_up(self) -> OffloadReport:
        start = time.perf_counter()
        moved = 0
        for storage, backup in self._backups:
            storage.resize_(backup.numel())
            _byte_view(storage).copy_(backup)
            moved += backup.numel()
        self._backups = []  # drop the host copies: nothing is kept across cycles
        _return_freed_host_memory()
        return OffloadReport(moved, time.perf_counter() - start)


def _return_freed_host_memory() -> None:
    # glibc keeps freed blocks of these sizes in its heap and raises its mmap threshold after
    # each large free, so without a trim every cycle's host copies add to the RSS for good.
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass

