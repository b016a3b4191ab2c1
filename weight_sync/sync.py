"""`sync_weights_colocated`: run on every trainer rank, pushes the model to its colocated engine."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch

from weight_sync.backend import Backend
from weight_sync.buckets import flatten_bucket, gather_full_tensor, group_into_buckets
from weight_sync.colocated import EngineWeightClient, serialize_bucket


@dataclass
class SyncStats:
    buckets: int = 0
    bytes: int = 0
    gather_s: float = 0.0
    handover_and_load_s: float = 0.0
    total_s: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def sync_weights_colocated(
    named_params: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    client: EngineWeightClient | None,
    weight_version: str,
    backend: Backend,
    engine_dtype: torch.dtype | None = None,
) -> SyncStats:
    """Gather buckets of full tensors (a collective: every rank must call this) and, on a rank
    that owns an engine (`client` set), hand each bucket to it by IPC handle.

    The engine's cache is flushed and its weight version set once, with the last bucket.
    """
    backend.prepare_ipc()
    stats = SyncStats()
    start = time.perf_counter()
    groups = list(group_into_buckets(named_params, bucket_bytes))
    if client is not None:
        client.begin()
    for index, group in enumerate(groups):
        tick = time.perf_counter()
        full = [(name, gather_full_tensor(tensor)) for name, tensor in group]
        if engine_dtype is not None:
            full = [(name, tensor.to(engine_dtype)) for name, tensor in full]
        stats.gather_s += time.perf_counter() - tick
        if client is not None:
            tick = time.perf_counter()
            bucket = flatten_bucket(full, share_memory=not backend.has_gpu, device=full[0][1].device)
            is_last = index == len(groups) - 1
            client.load_bucket(
                serialize_bucket(bucket),
                flush_cache=is_last,
                weight_version=weight_version if is_last else None,
            )
            stats.bytes += bucket.buffer.numel()
            del bucket  # the engine has loaded it: the handle may go
            stats.handover_and_load_s += time.perf_counter() - tick
        del full
        stats.buckets += 1
    if client is not None:
        client.end()
    stats.total_s = time.perf_counter() - start
    return stats
