"""Which devices `rlsys plan` plans for, and where their memory figure comes from: the GPUs the run
will get, as `rlsys train` decides from the Ray cluster's resources, not this machine's own devices
when it has none (a GPU-less head)."""

from __future__ import annotations

from collections.abc import Callable

from rlsys.config import ConfigError, RunConfig
from rlsys.model.shape import GiB


def plan_device(config: RunConfig, local_gpu_memory: int | None, host_memory: int,
                cluster: Callable[[], tuple[float, int | None]] | None = None) -> tuple[bool, int, str]:
    """`rlsys plan`'s device: (GPUs?, one device's memory, where that figure comes from).

    Like `rlsys train`, it plans the devices the run will get, not this machine's when this one
    has none (a GPU-less head): placement.device=cpu plans CPUs; a GPU here plans GPUs; else a Ray
    cluster named by placement.ray_address or RAY_ADDRESS is asked (`cluster`: its GPU count and
    its smallest GPU's memory, NVML on its nodes) and decides as `rlsys train` would; without one,
    placement.device=cuda or a placement.gpu_memory_gb (a GPU's memory) plans GPUs, and anything
    else CPUs, as `rlsys train` would run here. placement.gpu_memory_gb, when set, is the figure; a
    GPU plan whose GPUs cannot be read asks for it."""
    device, given_gb = config.placement.device, config.placement.gpu_memory_gb
    given = int(given_gb * GiB) if given_gb is not None else None
    if device == "cpu":
        return False, given or host_memory, "placement.gpu_memory_gb" if given else "this machine's RAM"
    if local_gpu_memory is not None:
        return True, given or local_gpu_memory, "placement.gpu_memory_gb" if given else "this machine's GPU"
    if cluster is not None:
        gpus, cluster_memory = cluster()
        if gpus <= 0:
            if device == "cuda":
                raise ConfigError("placement.device is cuda but the Ray cluster has no GPUs "
                                  "(ray.cluster_resources() lists none); start GPU workers or set placement.device=cpu")
            return False, given or host_memory, "the Ray cluster has no GPUs: a CPU run, " + (
                "placement.gpu_memory_gb" if given else "this machine's RAM")
        if given or cluster_memory:
            return True, given or cluster_memory, ("placement.gpu_memory_gb" if given else
                                                   "the smallest GPU of the Ray cluster (NVML)")
        raise ConfigError("the Ray cluster has GPUs but their memory could not be read (NVML): set "
                          "placement.gpu_memory_gb to plan for them")
    if device == "cuda" or given:
        if not given:
            raise ConfigError("placement.device is cuda but this machine has no GPU to read the memory of: set "
                              "placement.gpu_memory_gb to plan for the cluster's GPUs (or run where RAY_ADDRESS "
                              "names the cluster)")
        return True, given, "placement.gpu_memory_gb (no GPU on this machine)"
    return False, host_memory, ("this machine's RAM: no GPU here and no Ray cluster named (placement.ray_address, "
                                "RAY_ADDRESS); for GPUs set placement.gpu_memory_gb")


def _reachable(address: str, timeout_s: float = 5.0) -> None:
    """OSError unless a `host:port` address (with or without ray://) accepts a connection."""
    import socket

    host, _, port = address.removeprefix("ray://").rpartition(":")
    if host and port.isdigit():
        socket.create_connection((host, int(port)), timeout=timeout_s).close()


def cluster_gpus_and_memory(address: str) -> tuple[float, int | None]:
    """The Ray cluster at `address`: its GPUs, and the smallest GPU's memory (NVML in a zero-CPU
    task on each node that offers GPUs, as rlsys/system/node_checks.py reads the run's nodes; None
    when none answers within a minute)."""
    import logging

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from rlsys.system.backend import cluster_gpus
    from rlsys.system.node_checks import smallest_gpu_bytes

    joined = not ray.is_initialized()
    if joined:
        try:
            _reachable(address)  # ray.init retries an unreachable GCS for minutes
            ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
        except (OSError, RuntimeError) as error:
            raise ConfigError(f"cannot reach the Ray cluster at {address} (placement.ray_address or RAY_ADDRESS) to "
                              f"plan for its GPUs: {error}; or plan without it: placement.device=cuda "
                              "placement.gpu_memory_gb=80") from None
    try:
        gpus = cluster_gpus()
        probe = ray.remote(num_cpus=0, max_retries=0)(smallest_gpu_bytes)
        calls = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote()
                 for node in ray.nodes() if node["Alive"] and node["Resources"].get("GPU", 0) > 0]
        try:
            sizes = [size for size in ray.get(calls, timeout=60) if size]
        except ray.exceptions.GetTimeoutError:
            sizes = []
        return gpus, min(sizes) if sizes else None
    finally:
        if joined:
            ray.shutdown()
