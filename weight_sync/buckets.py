"""Walk parameters in size-bounded buckets and gather each bucket into one byte buffer.

Only one bucket of full (gathered) tensors exists at a time, so the extra memory of a sync stays
near one bucket. Tensors travel in the engine's dtype (`wire_dtype`): fp32 master weights are cast
shard by shard before the gather, so a bf16 engine's sync moves half the bytes. The layout is
SGLang's `flattened_bucket` format: a uint8 buffer plus, per tensor, its name, shape, dtype and
[start, end) byte range; shards are gathered straight into it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

_ALIGN_BYTES = 16  # keeps every tensor's view aligned for its dtype


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start: int  # byte offsets into the bucket buffer
    end: int


@dataclass
class WeightBucket:
    buffer: torch.Tensor  # uint8, 1-D
    metas: list[TensorMeta]

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Views into the buffer, one per tensor (no copy)."""
        return [
            (m.name, self.buffer[m.start:m.end].view(m.dtype).view(m.shape)) for m in self.metas
        ]


def as_checkpoint_tensors(bucket: WeightBucket, pieces: dict[str, list[tuple[str, tuple[int, ...]]]]) -> WeightBucket:
    """The bucket as the engine's `load_weights` names its tensors: each parameter in `pieces` (a
    stacked MoE parameter, rlsys/actors/checkpoint_layout.py) replaced by the checkpoint tensors
    that tile it, consecutive byte ranges of its own (no copy), in order."""
    if not pieces:
        return bucket
    metas = []
    for meta in bucket.metas:
        if meta.name not in pieces:
            metas.append(meta)
            continue
        start = meta.start
        for name, shape in pieces[meta.name]:
            end = start + math.prod(shape) * meta.dtype.itemsize
            metas.append(TensorMeta(name, torch.Size(shape), meta.dtype, start, end))
            start = end
        if start != meta.end:
            raise ValueError(f"{meta.name}: its pieces cover {start - meta.start} of its {meta.end - meta.start} bytes")
    return WeightBucket(buffer=bucket.buffer, metas=metas)


def wire_dtype(tensor: torch.Tensor, engine_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor travels in: the engine's for floating-point weights, else its own."""
    if engine_dtype is not None and tensor.dtype.is_floating_point:
        return engine_dtype
    return tensor.dtype


def full_nbytes(tensor: torch.Tensor, engine_dtype: torch.dtype | None = None) -> int:
    """Bytes of the full tensor in its wire dtype, even when `tensor` is a DTensor shard."""
    return tensor.numel() * wire_dtype(tensor, engine_dtype).itemsize


def group_into_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, engine_dtype: torch.dtype | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups whose full size stays within `bucket_bytes`; a larger tensor goes alone."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_bytes} bytes")
    group, size = [], 0
    for name, tensor in named_tensors:
        nbytes = full_nbytes(tensor, engine_dtype)
        if group and size + nbytes > bucket_bytes:
            yield group
            group, size = [], 0
        group.append((name, tensor))
        size += nbytes
    if group:
        yield group


def gather_into(tensor: torch.Tensor, out: torch.Tensor | None, dst: int | None = None,
                dtype: torch.dtype | None = None, tag: int = 0) -> list:
    """Write the full tensor into `out` (a view into a bucket), gathering FSDP2's even dim-0
    shards straight into it, so no extra copy of the bucket is made.

    `dst=None`: every rank receives the full tensor (an all-gather). `dst=r` (a rank of the
    default group): only rank r receives it and the others just send their shard, with `out=None`:
    half an all-gather's traffic on 2 ranks, and no staging buffer on the senders. A collective
    for DTensor shards: every rank calls it for the same tensors in the same order. `dtype`: the
    wire dtype (the shard is cast before it travels); default `out`'s, else the tensor's.
    Returns the works still in flight (the even-shard paths are asynchronous, so a bucket's
    tensors travel together instead of one round trip each: `gather_bucket` waits for them);
    `tag` tells apart the point-to-point messages of one bucket (its tensor's index)."""
    tensor = tensor.detach()
    dtype = dtype or (out.dtype if out is not None else tensor.dtype)
    if not hasattr(tensor, "full_tensor"):
        if out is not None:
            out.copy_(tensor)
        return []
    if not _in_even_dim0_shards(tensor):
        full = tensor.full_tensor()  # the general (collective) path for any other layout
        if out is not None:
            out.copy_(full)
        return []
    import torch.distributed as dist

    group = tensor.device_mesh.get_group()
    local = tensor.to_local().to(dtype).contiguous()  # the works hold it until they are waited for
    if dst is None:
        return [dist.all_gather_into_tensor(out, local, group=group, async_op=True)]
    return gather_shards_to(local, out, dst, group, tag)


def _in_even_dim0_shards(tensor: torch.Tensor) -> bool:
    """A DTensor sharded as FSDP2 shards: dim 0 split evenly over a 1-D mesh, so rank i's shard is
    the i-th contiguous chunk of the flattened full tensor."""
    from torch.distributed.tensor import Shard

    mesh, placements = tensor.device_mesh, tensor.placements
    even = tensor.shape[0] % mesh.size() == 0 if tensor.ndim else False
    return mesh.ndim == 1 and len(placements) == 1 and placements[0] == Shard(0) and even


def write_shard_into(tensor: torch.Tensor, out: torch.Tensor, receiver: bool) -> None:
    """Each rank's part of `gather_into` when every rank can write into `out`, the receiver's
    buffer mapped in each rank's memory (`weight_sync.shared_staging`): a rank copies its own
    even dim-0 shard straight into its chunk of `out` (cast to `out`'s dtype), no message sent.
    Other layouts are gathered by the collective `full_tensor` and a plain (replicated) tensor is
    copied, by the receiver alone. A collective for such layouts: every rank calls it for the same
    tensors in the same order; the caller orders the writes against the receiver's reads."""
    tensor = tensor.detach()
    if not hasattr(tensor, "full_tensor"):
        if receiver:
            out.copy_(tensor)
        return
    if not _in_even_dim0_shards(tensor):
        full = tensor.full_tensor()
        if receiver:
            out.copy_(full)
        return
    import torch.distributed as dist

    members = dist.get_process_group_ranks(tensor.device_mesh.get_group())
    chunks = out.reshape(-1).chunk(len(members))  # contiguous: shard i is chunk i of the flat tensor
    chunks[members.index(dist.get_rank())].copy_(tensor.to_local().reshape(-1))


def gather_shards_to(local: torch.Tensor, out: torch.Tensor | None, dst: int, group, tag: int = 0) -> list:
    """Even dim-0 shards of one tensor to rank `dst` by point-to-point sends into `out`; returns the
    sends and receives in flight (wait for each)."""
    import torch.distributed as dist

    me = dist.get_rank()
    if me != dst:
        return [dist.isend(local, dst, tag=tag)]
    if out is None:
        raise ValueError(f"rank {dst} receives the gathered tensor but was given no output buffer")
    members = dist.get_process_group_ranks(group)
    chunks = out.reshape(-1).chunk(len(members))  # contiguous: shard i is chunk i of the flat tensor
    requests = [dist.irecv(chunk, rank, tag=tag) for rank, chunk in zip(members, chunks, strict=True) if rank != me]
    chunks[members.index(me)].copy_(local.reshape(-1))
    return requests


def gather_full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on this rank: a collective for DTensor shards, a no-op otherwise."""
    tensor = tensor.detach()
    if hasattr(tensor, "full_tensor"):
        return tensor.full_tensor()
    return tensor


def bucket_layout(named_full_tensors: list[tuple[str, torch.Tensor]], alignment: int = _ALIGN_BYTES,
                  engine_dtype: torch.dtype | None = None,
                  ) -> tuple[list[tuple[str, torch.Tensor]], list[TensorMeta], int]:
    """(ordered tensors, their metadata, total bytes) of a bucket in wire dtypes, widest first so
    every view stays aligned for its dtype even with `alignment=1` (no padding: the layout SGLang's
    broadcast receiver computes itself)."""
    named_full_tensors = sorted(named_full_tensors, key=lambda item: -wire_dtype(item[1], engine_dtype).itemsize)
    metas, offset = [], 0
    for name, tensor in named_full_tensors:
        offset = (offset + alignment - 1) // alignment * alignment
        end = offset + full_nbytes(tensor, engine_dtype)
        metas.append(TensorMeta(name, tensor.shape, wire_dtype(tensor, engine_dtype), offset, end))
        offset = end
    return named_full_tensors, metas, offset


def gather_bucket(named_tensors: list[tuple[str, torch.Tensor]], buffer: torch.Tensor | None,
                  alignment: int = _ALIGN_BYTES, dst: int | None = None,
                  engine_dtype: torch.dtype | None = None) -> WeightBucket | None:
    """Gather (possibly sharded) tensors straight into `buffer`, laid out as `bucket_layout`.
    With `dst` set, ranks other than `dst` only send (pass `buffer=None`) and get None back."""
    ordered, metas, total = bucket_layout(named_tensors, alignment, engine_dtype)
    in_flight = []
    if buffer is None:
        if dst is None:
            raise ValueError("an all-gather (dst=None) needs an output buffer on every rank")
        for index, ((_, tensor), meta) in enumerate(zip(ordered, metas, strict=True)):  # the receiver's order
            in_flight += gather_into(tensor, None, dst, meta.dtype, tag=index)
        _wait_all(in_flight)
        return None
    if buffer.numel() < total:
        raise ValueError(f"staging buffer of {buffer.numel()} bytes is smaller than the bucket ({total})")
    bucket = WeightBucket(buffer=buffer[:total], metas=metas)
    for index, ((_, tensor), (_, view)) in enumerate(zip(ordered, bucket.tensors(), strict=True)):
        in_flight += gather_into(tensor, view, dst, tag=index)
    _wait_all(in_flight)
    return bucket


def write_bucket_shards(named_tensors: list[tuple[str, torch.Tensor]], buffer: torch.Tensor, alignment: int,
                        receiver: bool, engine_dtype: torch.dtype | None = None) -> WeightBucket | None:
    """`gather_bucket` into a buffer every rank has mapped: each rank writes its shards into the
    bucket laid out as `bucket_layout` (`write_shard_into`); the receiver gets the bucket back once
    the caller has seen every rank finish (the others get None)."""
    ordered, metas, total = bucket_layout(named_tensors, alignment, engine_dtype)
    if buffer.numel() < total:
        raise ValueError(f"staging buffer of {buffer.numel()} bytes is smaller than the bucket ({total})")
    bucket = WeightBucket(buffer=buffer[:total], metas=metas)
    for (_, tensor), (_, view) in zip(ordered, bucket.tensors(), strict=True):
        write_shard_into(tensor, view, receiver)
    return bucket if receiver else None


def _wait_all(works: list) -> None:
    for work in works:
        work.wait()
