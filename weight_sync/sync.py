"""`sync_weights`: run on every trainer rank; gathers buckets and hands them to a transport.

A transport is the colocated IPC client (`EngineWeightClient`, one per engine, on the rank that
shares its node) or the broadcast sender (`BroadcastWeightSender`, on rank 0 only). Ranks
without a transport still take part in every bucket's gather.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Protocol

import torch

from weight_sync.backend import Backend
from weight_sync.buckets import (
    WeightBucket,
    flatten_bucket,
    full_nbytes,
    gather_full_tensor,
    group_into_buckets,
)


class WeightTransport(Protocol):
    alignment: int

    def staging_buffer(self, nbytes: int, device: torch.device) -> torch.Tensor: ...
    def begin(self) -> None: ...
    def send_bucket(self, bucket: WeightBucket, flush_cache: bool, weight_version: str | None) -> None: ...
    def end(self) -> None: ...


@dataclass
class SyncStats:
    buckets: int = 0
    bytes: int = 0
    gather_s: float = 0.0
    flatten_s: float = 0.0
    handover_and_load_s: float = 0.0
    total_s: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def sync_weights(
    named_params: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    transport: WeightTransport | None,
    weight_version: str,
    backend: Backend,
    engine_dtype: torch.dtype | None = None,
) -> SyncStats:
    """Gather buckets of full tensors (a collective: every rank must call this) and, where a
    transport is given, send each one. The engines flush their cache and take the new weight
    version once, with the last bucket."""
    backend.prepare_ipc()
    stats = SyncStats()
    start = time.perf_counter()
    groups = list(group_into_buckets(named_params, bucket_bytes))
    if transport is not None:
        # One staging buffer, sized for the largest bucket (with alignment padding), reused by all.
        alignment = transport.alignment
        largest = max(sum(full_nbytes(t) + alignment for _, t in group) for group in groups)
        transport.begin()
    for index, group in enumerate(groups):
        tick = time.perf_counter()
        full = [(name, gather_full_tensor(tensor)) for name, tensor in group]
        if engine_dtype is not None:
            full = [(name, tensor.to(engine_dtype)) for name, tensor in full]
        stats.gather_s += time.perf_counter() - tick
        if transport is not None:
            tick = time.perf_counter()
            staging = transport.staging_buffer(largest, full[0][1].device)
            bucket = flatten_bucket(full, staging, alignment)
            stats.flatten_s += time.perf_counter() - tick
            tick = time.perf_counter()
            is_last = index == len(groups) - 1
            transport.send_bucket(bucket, flush_cache=is_last, weight_version=weight_version if is_last else None)
            stats.bytes += bucket.buffer.numel()
            del bucket  # loaded by the engine: the handle may go
            stats.handover_and_load_s += time.perf_counter() - tick
        del full
        stats.buckets += 1
    if transport is not None:
        transport.end()
    stats.total_s = time.perf_counter() - start
    return stats
