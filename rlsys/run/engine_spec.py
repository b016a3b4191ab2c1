"""The engines' launch spec, built one way for a run's own engines and for a standing set
(`rlsys engines up`), so that a run attaching to a set can be checked against it."""

from __future__ import annotations

from rlsys.config import RunConfig
from rlsys.rollout.sglang.server import ServerSpec
from rlsys.system.topology import Topology


def server_spec(config: RunConfig, topology: Topology, cpu_sharers: int) -> ServerSpec:
    """The engines' launch spec, as a run with its own engines builds it."""
    return ServerSpec(config.model, config.rollout.engine, config.seed, has_gpu=topology.has_gpu,
                      memory_saver=topology.trainers_sleep, cpu_sharers=cpu_sharers,
                      radix_cache=config.rollout.uses_radix_cache(topology.has_gpu),
                      pipelined_sync=config.weight_sync.pipelined, env=dict(config.placement.env),
                      return_routes=config.rollout.routing_replay == "rollout")
