"""`sync_weights`: run on every trainer rank; gathers buckets and hands them to a transport, as
one `SyncPlan` (the same on every rank) says.

A transport is the colocated IPC sender (`ColocatedWeightSender`, on the rank that shares the
engine's node) or the broadcast sender (`BroadcastWeightSender`, on rank 0 only), built for the
topology by transports.py. Ranks without a transport still take part in every bucket's gather.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from rlsys.system.backend import Backend
from rlsys.weight_sync.buckets import (
    WeightBucket,
    as_checkpoint_tensors,
    full_nbytes,
    gather_bucket,
    group_into_buckets,
    write_bucket_shards,
)
from rlsys.weight_sync.colocated import COLOCATED_ALIGNMENT, StagingBuffer
from rlsys.weight_sync.shared_staging import SharedStaging


class WeightTransport(Protocol):
    """Engine calls queued in order on the transport's own thread; each returns its future."""

    alignment: int

    def staging_buffer(self, slot: int, nbytes: int, device: torch.device) -> torch.Tensor: ...
    def release_staging_buffer(self) -> None: ...
    def begin(self) -> Future: ...
    def send_bucket(self, bucket: WeightBucket, flush_cache: bool, weight_version: str | None) -> Future: ...
    def end(self) -> Future: ...
    def close(self) -> None: ...


@dataclass
class SyncStats:
    buckets: int = 0
    bytes: int = 0  # bucket bytes handed to the transport (0 on ranks without one)
    gather_s: float = 0.0  # all-gather straight into a staging buffer (the bucket)
    engine_wait_s: float = 0.0  # waiting for the engine: its load of a bucket not hidden behind a gather
    total_s: float = 0.0
    pipelined: bool = True
    # How shards reached the buffers: "all_gather", "point_to_point" (to the one receiving rank) or
    # "shared_memory" (every rank wrote its own into the receiver's buffer), "none" (one rank).
    gathered_by: str = "none"

    @property
    def gbps(self) -> float:
        return self.bytes / self.total_s / 1e9 if self.total_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "gbps": self.gbps}


def staging_slot_bytes(named_params: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                       alignment: int = COLOCATED_ALIGNMENT, engine_dtype: torch.dtype | None = None,
                       pipelined: bool = True) -> list[int]:
    """Bytes of each staging buffer `sync_weights` allocates on a rank with a transport. Pipelined,
    bucket k is gathered into slot k % 2 while the engine loads bucket k - 1 from the other slot,
    so each slot is its largest bucket; serial (or with one bucket), one slot holds them all in turn.
    A bucket is its tensors in their wire dtype plus `alignment` bytes of padding each, so a slot is
    at least its largest tensor (a tensor larger than a bucket travels alone: the output layer,
    often). Shapes are all it reads: the parameters may be on the meta device (the memory plan's
    model), and DTensor shards count at their full size."""
    sizes = [sum(full_nbytes(t, engine_dtype) + alignment for _, t in group)
             for group in group_into_buckets(named_params, bucket_bytes, engine_dtype)]
    if not pipelined or len(sizes) < 2:
        return [max(sizes, default=0)]
    return [max(sizes[0::2]), max(sizes[1::2])]


def staging_buffer_bytes(named_params: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                         alignment: int = COLOCATED_ALIGNMENT, engine_dtype: torch.dtype | None = None,
                         pipelined: bool = True) -> int:
    """All the staging memory of a rank with a transport (`staging_slot_bytes`, summed)."""
    return sum(staging_slot_bytes(named_params, bucket_bytes, alignment, engine_dtype, pipelined))


@dataclass(frozen=True)
class SyncPlan:
    """One sync, the same on every rank (what `sync_weights` used to take as flags).

    `pipelined`: bucket k+1 is gathered while the engine loads bucket k (two staging buffers taking
    turns; a buffer is gathered into again only once the engine has loaded what it held); else
    each bucket is loaded before the next is gathered (one buffer). The engine calls keep their
    order either way (begin, the buckets, end), and `begin` is answered while bucket 0 gathers.
    `gather_dst`: the one rank that holds a transport, when only one does (broadcast, or a single
    colocated engine): shards then go only there and the other ranks need no buffer.
    `engine_dtype`: the dtype the engine serves; floating-point weights are cast to it shard by
    shard before they travel (fp32 master weights into a bf16 engine: half the bytes).
    `pieces`: the checkpoint tensors some parameters are sent as (actors/checkpoint_layout.py)."""

    bucket_bytes: int
    weight_version: str
    engine_dtype: torch.dtype | None = None
    pipelined: bool = True
    gather_dst: int | None = None
    pieces: Mapping[str, list[tuple[str, tuple[int, ...]]]] = field(default_factory=dict)


def sync_weights(
    named_params: Iterable[tuple[str, torch.Tensor]],
    plan: SyncPlan,
    transport: WeightTransport | None,
    backend: Backend,
    scratch: StagingBuffer | None = None,
    materialize: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
    shared_staging: SharedStaging | None = None,
) -> SyncStats:
    """Gather buckets of full tensors (a collective: every rank must call this) and, where a
    transport is given, send each one. Shards are gathered straight into reusable staging buffers:
    the transport's, or `scratch` on ranks that only take part in an all-gather.
    `materialize(name, tensor)`: the tensor to send for each listed one, computed when its bucket is
    gathered (LoRA's merged weights, actors/lora.py; a collective where the listed tensors are).
    `shared_staging`: with `plan.gather_dst`, on every rank: the ranks share host memory, and each
    writes its own shards straight into the receiver's staging buffers (which it maps) instead of
    sending them; two barriers per bucket order the writes after the engine's load of what the
    buffer held before, and the hand-over after every rank's writes.
    The engines flush their cache and take the new weight version once, with the last bucket.
    An engine that fails mid-sync does not stop this rank's gathers: the other ranks are in them,
    and leaving would hang them; the first failure is raised once every bucket has been gathered
    (and the session closed)."""
    if transport is not None and plan.gather_dst is not None and plan.gather_dst != _rank():
        raise ValueError(f"this rank ({_rank()}) holds a transport but the gathers go to rank {plan.gather_dst}")
    if shared_staging is not None and plan.gather_dst is None:
        raise ValueError("shards are written into shared staging buffers only for one receiving rank (gather_dst)")
    backend.prepare_ipc()
    start = time.perf_counter()
    run = _Sync(plan, transport, backend, list(group_into_buckets(named_params, plan.bucket_bytes, plan.engine_dtype)))
    run.stage(scratch, shared_staging)
    begun = transport.begin() if transport is not None else None
    if begun is not None and not plan.pipelined:
        run.settle(begun)
    for index, group in enumerate(run.groups):
        run.gather_and_send(index, group, materialize)
    if transport is not None:
        for future in [begun, *run.loading.values()]:
            run.settle(future)
        ended = _wait(transport.end(), run.stats)  # also after a failure: the engines that hear must close it
        run.failure = run.failure or ended
    if run.failure is not None:
        raise run.failure
    run.stats.total_s = time.perf_counter() - start
    return run.stats


class _Sync:
    """One `sync_weights` call's state: its buckets, staging buffers, the engine loads in flight
    and the first engine failure (kept, not raised, until every gather is done)."""

    def __init__(self, plan: SyncPlan, transport: WeightTransport | None, backend: Backend,
                 groups: list[list[tuple[str, torch.Tensor]]]):
        self.plan, self.transport, self.backend, self.groups = plan, transport, backend, groups
        self.stats = SyncStats(pipelined=plan.pipelined)
        self.failure: Exception | None = None
        self.loading: dict[int, Future] = {}  # staging slot -> the engine call still reading it
        self.alignment = transport.alignment if transport is not None else 1
        self.staging: Callable[[int], torch.Tensor] | None = None
        self.shared_slots: list[torch.Tensor] | None = None

    def stage(self, scratch: StagingBuffer | None, shared_staging: SharedStaging | None) -> None:
        """Where each bucket is gathered: this rank's buffers, or every rank writing into the
        receiver's (mapped on every rank; as many as `staging_slot_bytes` sizes)."""
        plan = self.plan
        named = [item for group in self.groups for item in group]
        self.staging = _staging_for(self.transport, scratch, plan.gather_dst, named, plan.bucket_bytes, self.alignment,
                                    plan.engine_dtype, plan.pipelined)
        if shared_staging is not None:
            slots = 2 if plan.pipelined and len(self.groups) > 1 else 1
            mine = [self.staging(i) for i in range(slots)] if self.staging is not None else None
            self.shared_slots, self.alignment = shared_staging.exchange(mine, self.alignment, plan.gather_dst)
        self.stats.gathered_by = _gathered_by(self.shared_slots is not None, plan.gather_dst, named)

    def gather_and_send(self, index: int, group: list[tuple[str, torch.Tensor]],
                        materialize: Callable[[str, torch.Tensor], torch.Tensor] | None) -> None:
        plan, transport = self.plan, self.transport
        slot = index % 2 if plan.pipelined else 0
        if slot in self.loading:  # the engine still reads this buffer: wait for its load
            self.settle(self.loading.pop(slot))
        tick = time.perf_counter()
        if materialize is not None:
            group = [(name, materialize(name, tensor)) for name, tensor in group]
        if self.shared_slots is not None:
            dist.barrier()  # the receiver may write: the engine is done with what this buffer held
            bucket = write_bucket_shards(group, self.shared_slots[index % len(self.shared_slots)], self.alignment,
                                         receiver=transport is not None, engine_dtype=plan.engine_dtype)
            dist.barrier()  # every rank's shards are in the bucket
        else:
            buffer = self.staging(index) if self.staging is not None else None
            bucket = gather_bucket(group, buffer, self.alignment, plan.gather_dst, plan.engine_dtype)
        self.stats.gather_s += time.perf_counter() - tick
        self.stats.buckets += 1
        if transport is None or self.failure is not None:
            return
        self.backend.finish_device_writes()  # the engine reads the bucket on a stream of its own
        is_last = index == len(self.groups) - 1
        self.loading[slot] = transport.send_bucket(as_checkpoint_tensors(bucket, plan.pieces), flush_cache=is_last,
                                                   weight_version=plan.weight_version if is_last else None)
        self.stats.bytes += bucket.buffer.numel()
        if not plan.pipelined:
            self.settle(self.loading.pop(slot))

    def settle(self, future: Future) -> None:
        """Wait for an engine call; its error, if the first, is kept (see `sync_weights`)."""
        self.failure = self.failure or _wait(future, self.stats)


def _staging_for(transport: WeightTransport | None, scratch: StagingBuffer | None, gather_dst: int | None,
                 named: list[tuple[str, torch.Tensor]], bucket_bytes: int, alignment: int,
                 engine_dtype: torch.dtype | None, pipelined: bool) -> Callable[[int], torch.Tensor] | None:
    """The buffer bucket `index` is gathered into on this rank, or None where the rank only sends
    its shards to `gather_dst`."""
    device = named[0][1].device
    if transport is not None:
        slots = staging_slot_bytes(named, bucket_bytes, alignment, engine_dtype, pipelined)
        return lambda index: transport.staging_buffer(index % len(slots), slots[index % len(slots)], device)
    if gather_dst is None:  # an all-gather: nothing reads the buffer after it, one is enough
        largest = staging_buffer_bytes(named, bucket_bytes, alignment, engine_dtype, pipelined=False)
        scratch = scratch or StagingBuffer(share_memory=False)
        return lambda index: scratch.get(largest, device)
    return None


def _gathered_by(shared: bool, gather_dst: int | None, named: list[tuple[str, torch.Tensor]]) -> str:
    if not any(hasattr(tensor, "full_tensor") for _, tensor in named):
        return "none"  # one rank holds the whole model
    if shared:
        return "shared_memory"
    return "all_gather" if gather_dst is None else "point_to_point"


def _wait(future: Future, stats: SyncStats) -> Exception | None:
    """The engine call's outcome (its error, not raised: see `sync_weights`), the wait counted."""
    tick = time.perf_counter()
    try:
        future.result()
    except Exception as error:  # noqa: BLE001 - raised by sync_weights after the collectives
        return error
    finally:
        stats.engine_wait_s += time.perf_counter() - tick
    return None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
