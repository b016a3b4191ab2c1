"""The receiving rank's staging buffers, mapped by every trainer rank of its node.

When one rank feeds the only engine (`Topology.gather_dst`) and the ranks share host memory
(`Backend.ranks_write_into_shared_staging`: CPU), each rank writes its own shards straight into
that rank's staging buffers instead of sending them (`weight_sync.buckets.write_bucket_shards`).
The buffers already live in shared memory, since the colocated transport hands them to the engine
by handle; at the start of each sync the receiver sends the same kind of handle to the other ranks
(a few hundred bytes). Barriers order the writes: see `weight_sync.sync.sync_weights`.
"""

from __future__ import annotations

import io
import os
import pickle
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # noqa: F401 - registers torch's tensor reductions with ForkingPickler


def node_memory_identity(address: str) -> tuple[str, int, int]:
    """What tells apart the shared memories of two processes: their node's address, and which
    file system is their /dev/shm (one machine's containers or mount namespaces each have their
    own)."""
    shm = os.stat("/dev/shm")
    return address, shm.st_dev, shm.st_ino


class SharedStaging:
    """One rank's view of the receiving rank's staging buffers for the current sync.

    Every handle is unpickled exactly once: pickling a shared-memory tensor takes a reference on
    its file that unpickling returns. Unpickling the handle of a buffer this rank already maps
    returns the same mapping (torch's shared-storage cache), so a buffer reused from sync to sync
    is mapped once and its pages stay warm; `release` lets go of them (the receiver drops its
    buffers when the trainer sleeps, and their memory is freed once no rank maps them)."""

    def __init__(self):
        self._slots: list[torch.Tensor] = []

    def exchange(self, mine: list[torch.Tensor] | None, alignment: int, receiver: int) -> tuple[list[torch.Tensor], int]:
        """A collective: the receiver passes its slots and its transport's alignment, every other
        rank None; each gets (the slots, mapped, the alignment the bucket layout uses)."""
        import torch.distributed as dist

        payload = [None]
        if mine is not None:  # one pickle per rank that unpickles it (each takes one reference)
            payload = [([None if rank == receiver else _pickled(mine) for rank in range(dist.get_world_size())],
                        alignment)]
        dist.broadcast_object_list(payload, src=receiver)
        if mine is not None:
            return mine, alignment
        handles, alignment = payload[0]
        self._slots = pickle.loads(handles[dist.get_rank()])
        return self._slots, alignment

    def release(self) -> None:
        self._slots = []


def _pickled(tensors: list[torch.Tensor]) -> bytes:
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(tensors)
    return buffer.getvalue()
