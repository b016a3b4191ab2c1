"""The weight transport of one trainer rank, built for the run's topology (rlsys/system/topology.py):
the IPC sender to the colocated engine the rank feeds, the broadcast sender to every engine (rank 0,
disaggregated), or none (the rank only joins the gathers); and whether the ranks write their shards
straight into the feeding rank's staging buffers. The trainer asks for these and sends through
them: the SGLang clients and senders are built here, not in the trainer."""

from __future__ import annotations

import torch.distributed as dist

from rlsys.rollout.sglang.client import SGLangClient, check_reachable
from rlsys.system.backend import Backend
from rlsys.system.node import node_address
from rlsys.system.topology import Topology
from rlsys.weight_sync.broadcast import BroadcastWeightSender
from rlsys.weight_sync.colocated import ColocatedWeightSender
from rlsys.weight_sync.shared_staging import SharedStaging, node_memory_identity
from rlsys.weight_sync.sync import WeightTransport


def connect_transport(topology: Topology, rank: int, backend: Backend, timeout_s: float) -> WeightTransport | None:
    """This rank's sender, connected (its engines checked reachable first), or None."""
    me = f"trainer rank {rank} on node {node_address()}"
    if topology.transport == "broadcast":
        if rank != 0:
            return None
        engines = [SGLangClient(address, timeout_s) for address in topology.engines]
        for engine in engines:
            check_reachable(engine, me)
        sender = BroadcastWeightSender(engines, backend, node_address(), timeout_s)
        sender.connect()
        return sender
    index = topology.engine_fed_by(rank)
    if index is None:
        return None
    engine = topology.engines[index]
    client = SGLangClient(engine)
    check_reachable(client, me)
    return ColocatedWeightSender(client, engine.tp_size)


def shared_staging_for(topology: Topology, world_size: int, backend: Backend) -> SharedStaging | None:
    """Whether a sync's shards are written straight into the feeding rank's staging buffers
    (shared_staging.py): one colocated engine, a backend whose ranks share host memory, and every
    rank in the same shared memory as that rank. Decided by every rank from the same all-gathered
    facts (a collective), so all ranks take the same path."""
    if (topology.transport != "ipc" or topology.gather_dst is None or world_size < 2
            or not backend.ranks_write_into_shared_staging):
        return None
    memories = [None] * world_size
    dist.all_gather_object(memories, node_memory_identity(node_address()))
    return SharedStaging() if len(set(memories)) == 1 else None
