"""Between the nodes of a run: can each reach the ports the others open, do their clocks agree, and
do the collectives the run depends on form and move data, at what bandwidth.

A `NodeAgent` is one process on one node of the placement (a Ray actor in a bundle the run's
trainers or engines would take, with their environment: placement.env). It opens a listening
socket as the run's processes do (a free port on the node's Ray address: trainer rank 0's store,
the weight-update group, SGLang's HTTP server), connects to the other agents' sockets, reads its
clock, and joins a torch.distributed group over the backend the run uses (`make_backend`: NCCL on
GPUs, gloo on CPUs; gloo bound to the node address's interface as the ranks bind it) for an
all-reduce over every agent and a broadcast between every pair. `rlsys doctor` drives them
(rlsys/doctor/examine.py).

Bandwidths follow nccl-tests' definitions (its doc/PERFORMANCE.md): a broadcast's bandwidth is
bytes / time; an all-reduce's "bus bandwidth" is bytes / time * 2 (n - 1) / n, what each link
carries, comparable across group sizes.
"""

from __future__ import annotations

import itertools
import socket
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class CollectiveResult:
    """What one agent measured (every agent returns one; rank 0's is reported)."""

    backend: str
    nbytes: int
    all_reduce_s: float
    all_reduce_correct: bool
    broadcast_s: dict[str, float] = field(default_factory=dict)  # "i-j" (source i) -> seconds, pairs this rank was in


def all_reduce_bus_bandwidth(nbytes: int, seconds: float, world: int) -> float:
    """Bytes per second each link carried (nccl-tests' busbw for all-reduce)."""
    return nbytes / seconds * 2 * (world - 1) / world if seconds > 0 else float("inf")


class NodeAgent:
    """One node's side of the network checks (module docstring)."""

    def __init__(self, has_gpu: bool):
        self.has_gpu = has_gpu
        self._listener: socket.socket | None = None
        self._reserved = None  # the group store's port, held from free_port until collectives serves it

    def node(self) -> tuple[str, str]:
        """(Ray node id, node address)."""
        import ray

        from rlsys.system.node import node_address

        return ray.get_runtime_context().get_node_id(), node_address()

    def open_port(self) -> tuple[str, int]:
        """A listening socket on a free port of the node's address, as a run's processes pick theirs;
        it stays open until `close_port`."""
        from rlsys.system.node import node_address

        address = node_address()
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((address, 0))
        listener.listen(64)
        self._listener = listener
        return address, listener.getsockname()[1]

    def close_port(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def reach(self, targets: list[tuple[str, int]], timeout_s: float) -> dict[str, str | None]:
        """"address:port" -> None when a TCP connection opened, else why not."""
        return {f"{host}:{port}": connect_problem(host, port, timeout_s) for host, port in targets}

    def clock(self) -> float:
        return time.time()

    def free_port(self) -> int:
        """A port on this node's address for the group's store, which rank 0 serves: held until then,
        as the run's trainer rank 0 holds its own (system/rendezvous.py)."""
        from rlsys.system.node import node_address
        from rlsys.system.rendezvous import ReservedPort

        self._reserved = ReservedPort(node_address())
        return self._reserved.port

    def collectives(self, master: str, port: int, rank: int, world: int, nbytes: int, repeats: int,
                    timeout_s: float) -> CollectiveResult:
        """Join the group and time an all-reduce over everyone, then a broadcast between every pair
        (every rank creates every pair's group: torch's new_group is collective)."""
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        from rlsys.system.backend import make_backend
        from rlsys.system.node import bind_gloo_to_node_address, node_address
        from rlsys.system.rendezvous import rank_store

        backend = make_backend(self.has_gpu)
        bind_gloo_to_node_address(node_address())
        device = backend.device()
        timeout = timedelta(seconds=timeout_s)
        store = rank_store(rank, master, port, world, timeout, self._reserved)
        self._reserved = None
        dist.init_process_group(backend.dist_backend, store=store, rank=rank, world_size=world, timeout=timeout,
                                **({"device_id": device} if self.has_gpu else {}))
        try:
            tensor = torch.full((nbytes // 4,), float(rank + 1), dtype=torch.float32, device=device)
            dist.all_reduce(tensor)  # also the warm-up: connections form on first use
            correct = bool((tensor == world * (world + 1) / 2).all())
            all_reduce_s = self._timed(lambda: dist.all_reduce(tensor), repeats)
            broadcasts = {}
            for source, target in itertools.combinations(range(world), 2):
                pair = dist.new_group([source, target])
                if rank in (source, target):
                    dist.broadcast(tensor, src=source, group=pair)  # warm-up
                    broadcasts[f"{source}-{target}"] = self._timed(
                        lambda pair=pair, source=source: dist.broadcast(tensor, src=source, group=pair), repeats)
                dist.barrier()
            return CollectiveResult(backend.dist_backend, nbytes, all_reduce_s, correct, broadcasts)
        finally:
            dist.destroy_process_group()

    def _timed(self, collective, repeats: int) -> float:
        """Seconds per call, device work included."""
        import torch

        if self.has_gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            collective()
        if self.has_gpu:
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / repeats


def connect_problem(host: str, port: int, timeout_s: float) -> str | None:
    """None when a TCP connection to host:port opens within `timeout_s`, else what went wrong."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except TimeoutError:
        return f"no answer within {timeout_s:g} s (a firewall dropping the packets?)"
    except OSError as error:
        return error.strerror or str(error)
    return None
