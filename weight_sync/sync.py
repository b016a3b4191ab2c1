"""`sync_weights`: run on every trainer rank; gathers buckets and hands them to a transport.

A transport is the colocated IPC sender (`ColocatedWeightSender`, on the rank that shares the
engine's node) or the broadcast sender (`BroadcastWeightSender`, on rank 0 only). Ranks without
a transport still take part in every bucket's gather.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Protocol

import torch

from rlsys.system.backend import Backend
from rlsys.weight_sync.buckets import (
    WeightBucket,
    as_checkpoint_tensors,
    full_nbytes,
    gather_bucket,
    group_into_buckets,
)
from rlsys.weight_sync.colocated import COLOCATED_ALIGNMENT, StagingBuffer


class WeightTransport(Protocol):
    alignment: int

    def staging_buffer(self, nbytes: int, device: torch.device) -> torch.Tensor: ...
    def release_staging_buffer(self) -> None: ...
    def begin(self) -> None: ...
    def send_bucket(self, bucket: WeightBucket, flush_cache: bool, weight_version: str | None) -> None: ...
    def end(self) -> None: ...


@dataclass
class SyncStats:
    buckets: int = 0
    bytes: int = 0
    gather_s: float = 0.0  # all-gather straight into the staging buffer (the bucket)
    handover_and_load_s: float = 0.0
    total_s: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def staging_buffer_bytes(named_params: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                         alignment: int = COLOCATED_ALIGNMENT, engine_dtype: torch.dtype | None = None) -> int:
    """Bytes of the staging buffer `sync_weights` allocates: its largest bucket, each tensor in its
    wire dtype plus `alignment` bytes of padding. Not `bucket_bytes`: a tensor larger than a bucket
    travels alone, so the buffer is at least the largest tensor (the output layer, often). Shapes
    are all it reads: the parameters may be on the meta device (the memory plan's model), and
    DTensor shards count at their full size."""
    groups = group_into_buckets(named_params, bucket_bytes, engine_dtype)
    return max((sum(full_nbytes(t, engine_dtype) + alignment for _, t in group) for group in groups), default=0)


def sync_weights(
    named_params: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    transport: WeightTransport | None,
    weight_version: str,
    backend: Backend,
    scratch: StagingBuffer | None = None,
    gather_dst: int | None = None,
    engine_dtype: torch.dtype | None = None,
    pieces: dict[str, list[tuple[str, tuple[int, ...]]]] | None = None,
    materialize: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> SyncStats:
    """Gather buckets of full tensors (a collective: every rank must call this) and, where a
    transport is given, send each one. Shards are gathered straight into one reusable staging
    buffer: the transport's, or `scratch` on ranks that only take part in an all-gather.
    `gather_dst`: the one rank that holds a transport, when only one does (broadcast, or a single
    colocated engine): shards then go only there and the other ranks need no buffer.
    `engine_dtype`: the dtype the engine serves; floating-point weights are cast to it shard by
    shard before they travel (fp32 master weights into a bf16 engine: half the bytes).
    `materialize(name, tensor)`: the tensor to send for each listed one, computed when its bucket is
    gathered (LoRA's merged weights, actors/lora.py; a collective where the listed tensors are).
    The engines flush their cache and take the new weight version once, with the last bucket.
    An engine that fails mid-sync does not stop this rank's gathers: the other ranks are in them,
    and leaving would hang them; the first failure is raised once every bucket has been gathered."""
    if transport is not None and gather_dst is not None and gather_dst != _rank():
        raise ValueError(f"this rank ({_rank()}) holds a transport but the gathers go to rank {gather_dst}")
    backend.prepare_ipc()
    stats = SyncStats()
    start = time.perf_counter()
    groups = list(group_into_buckets(named_params, bucket_bytes, engine_dtype))
    alignment = transport.alignment if transport is not None else 1
    # One staging buffer, sized for the largest bucket (with alignment padding), reused by all.
    largest = staging_buffer_bytes([item for group in groups for item in group], bucket_bytes, alignment,
                                   engine_dtype)
    device = next(iter(groups[0]))[1].device
    if transport is not None:
        staging = transport.staging_buffer
    elif gather_dst is None:
        staging = (scratch or StagingBuffer(share_memory=False)).get
    else:
        staging = None  # this rank only sends its shards to `gather_dst`
    failure = _attempt(transport.begin) if transport is not None else None  # deferred: see the docstring
    for index, group in enumerate(groups):
        tick = time.perf_counter()
        buffer = staging(largest, device) if staging is not None else None
        if materialize is not None:
            group = [(name, materialize(name, tensor)) for name, tensor in group]
        bucket = gather_bucket(group, buffer, alignment, gather_dst, engine_dtype)
        stats.gather_s += time.perf_counter() - tick
        if transport is not None and failure is None:
            tick = time.perf_counter()
            is_last = index == len(groups) - 1
            failure = _attempt(transport.send_bucket, as_checkpoint_tensors(bucket, pieces or {}), flush_cache=is_last,
                               weight_version=weight_version if is_last else None)
            stats.bytes += bucket.buffer.numel()
            stats.handover_and_load_s += time.perf_counter() - tick
        del bucket  # loaded by the engine: the staging buffer may be reused
        stats.buckets += 1
    if transport is not None:
        # Also after a failure: the engines that can still hear must not keep the session open.
        ended = _attempt(transport.end)
        failure = failure or ended
    if failure is not None:
        raise failure
    stats.total_s = time.perf_counter() - start
    return stats


def _attempt(call, *args, **kwargs) -> Exception | None:
    try:
        call(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - raised by sync_weights after the collectives
        return error
    return None


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0
