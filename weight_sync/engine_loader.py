"""Engine-side half of the colocated transport: runs inside the SGLang server process.

SGLang calls `load_bucket(model, named_tensors)` for `/update_weights_from_tensor` requests whose
`load_format` is this function's import path (`LOAD_FORMAT`); the server is started with
`--custom-weight-loader` naming it (`rlsys.rollout.sglang.server.build_command`). The tensors are views into
the trainer's staging buffer, opened from one IPC handle (torch caches the opened storage by
handle, so a bucket maps its buffer once, not once per tensor).

Two things make it faster than SGLang's built-in `flattened_bucket` loader:

1. Host staging memory stays mapped between the buckets of a sync. The trainer reuses two staging
   buffers in turn (it gathers into one while the engine loads from the other), so the engine
   keeps a reference to both; the next bucket finds the mapping (and its populated page tables)
   in torch's handle cache instead of mapping the file again and faulting every page in. The
   sync's last bucket ends with an `END_OF_SYNC` entry (an empty view of its buffer) and the
   references are dropped once it is loaded; an empty bucket does the same
   for a sync that failed before its last bucket (`ColocatedWeightSender.end`). torch's
   shared-memory files are refcounted across processes and removed when the last holder lets go,
   so an engine holding one between syncs would leave it behind if it were killed.
   Device (CUDA IPC) memory is not kept at all: that would pin GPU memory on the trainer's side.
2. The copy into the parameters uses `RLSYS_WEIGHT_LOAD_THREADS` intra-op threads (set by the
   launcher to the cores of the engine's node). During a colocated sync the trainer ranks wait on
   the engine, so the load may use their cores; generation keeps the engine's own thread count.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where the loader runs (the engine); its launcher needs only the names
    import torch

LOAD_FORMAT = "rlsys.weight_sync.engine_loader.load_bucket"
LOAD_THREADS_ENV = "RLSYS_WEIGHT_LOAD_THREADS"
# Name of the entry that closes a sync's last bucket: load it, then let go of the staging buffer
# (one request fewer than a separate empty bucket: each costs a round trip through the scheduler).
END_OF_SYNC = "rlsys.end_of_sync"
_KEPT_STORAGE_ATTR = "_rlsys_kept_staging_storage"
# Not a weight load: SGLang runs a request's custom `load_format` function in the TP worker that
# samples (the one piece of our code inside the server), and this one restarts that worker's random
# streams at the seed its one entry names, as `--random-seed` did at start-up. A run attached to
# standing engines sends it after its first weight push, so what it samples follows from its own
# seed, not from what earlier runs drew from the same engine (`RolloutEngine.restart_random_stream`).
SEED_LOAD_FORMAT = "rlsys.weight_sync.engine_loader.restart_random_streams"


def seed_entry(seed: int) -> tuple[str, torch.Tensor]:
    """The one entry of a SEED_LOAD_FORMAT request: the seed as its name, and an empty tensor (it
    pickles without shared memory, so the request reaches a server on another node too)."""
    import torch

    return str(int(seed)), torch.empty(0)


def restart_random_streams(model: torch.nn.Module, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """SEED_LOAD_FORMAT's function: `model` is not touched."""
    [(seed, _)] = named_tensors
    _restart_random_streams(int(seed))


def load_bucket(model: torch.nn.Module, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    ends_sync = not named_tensors or named_tensors[-1][0] == END_OF_SYNC
    weights = [(name, tensor) for name, tensor in named_tensors if name != END_OF_SYNC]
    if weights:
        first = weights[0][1]
        _keep_host_staging_mapped(model, first)
        try:
            # Host copies scale with threads; a device copy does not need (or want) a big host pool.
            with _intra_op_threads(_load_threads() if first.device.type == "cpu" else None):
                model.load_weights(weights)
        finally:  # a failed load may have queued copies too
            _finish_device_reads(first.device)
    if ends_sync:
        setattr(model, _KEPT_STORAGE_ATTR, None)


def _restart_random_streams(seed: int) -> None:
    """SGLang's own seeding (sglang/srt/utils/common.py, set_random_seed: Python, NumPy, torch and
    every CUDA device), the call its scheduler and TP worker make once at start-up. Sampling draws
    from torch's default generator of the device (layers/sampler.py, torch.multinomial), which this
    process owns: the loader runs in the TP worker that samples."""
    from sglang.srt.utils import set_random_seed

    set_random_seed(seed)


def _finish_device_reads(device: torch.device) -> None:
    """Wait until the copies `load_weights` queued on this thread's stream have read the trainer's
    buffer: SGLang answers the request once the loader returns, and the trainer then gathers the
    next bucket into that same staging buffer. Host copies are done when they return.

    SGLang 0.5.23 does not wait for them itself: the scheduler's
    `update_weights_from_tensor` (managers/scheduler_components/weight_updater.py) unpickles, calls
    the runner's `update_weights_from_tensor` (model_executor/model_runner_components/
    weight_updater.py: `_unwrap_tensor(...).to(device)`, then this loader), flushes the cache,
    meets the other TP ranks at a barrier of the CPU group (`tp_cpu_group`) and answers; nothing on
    that path synchronizes a device. The only wait is torch's: the deleter of a tensor opened by
    CUDA IPC synchronizes the current stream before it returns the sender's reference count
    (torch/csrc/StorageSharing.cpp, THPStorage_newSharedCuda), and it runs only when the engine
    drops the last reference to the mapped tensors: on TP rank 0 as the handler returns, on the
    other ranks after the barrier, perhaps after rank 0 has answered. Waiting here, before the
    barrier, orders every rank's reads before the answer. A copy from another GPU (`.to(device)`)
    runs on that GPU's current stream, which this device's current stream is made to wait on
    (aten/src/ATen/native/cuda/Copy.cu, copy_device_to_device), so this wait covers it too."""
    if device.type != "cuda":
        return
    import torch

    torch.cuda.current_stream(device).synchronize()


def _keep_host_staging_mapped(model: torch.nn.Module, tensor: torch.Tensor) -> None:
    # The two newest buffers are kept (the trainer's two slots): a trainer that replaced a staging
    # buffer never sends the old one again. Stored on the model so no state outlives the engine's
    # weights.
    if tensor.device.type != "cpu":
        setattr(model, _KEPT_STORAGE_ATTR, None)
        return
    storage = tensor.untyped_storage()
    kept = [s for s in getattr(model, _KEPT_STORAGE_ATTR, None) or () if s.data_ptr() != storage.data_ptr()]
    setattr(model, _KEPT_STORAGE_ATTR, tuple([*kept[-1:], storage]))


def _load_threads() -> int | None:
    value = os.environ.get(LOAD_THREADS_ENV, "")
    try:
        threads = int(value)
    except ValueError:
        return None
    return threads if threads > 0 else None


@contextmanager
def _intra_op_threads(threads: int | None):
    import torch

    previous = torch.get_num_threads()
    if threads is None or threads == previous:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
