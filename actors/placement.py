"""Ray placement: one placement group laid out as the topology says (`rlsys.system.topology`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlsys.system.topology import CPUS_PER_ACTOR, Slot, Topology

logger = logging.getLogger(__name__)


@dataclass
class Placement:
    group: PlacementGroup
    topology: Topology
    owned: bool = True  # False: a standing engine set's (rollout/standing.py), which outlives the run

    def _options(self, slot: Slot) -> dict:
        return {
            "num_cpus": CPUS_PER_ACTOR,
            "num_gpus": slot.gpus,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.group, placement_group_bundle_index=slot.bundle
            ),
        }

    def trainer_options(self) -> list[dict]:
        return [self._options(self.topology.trainer_slot(rank)) for rank in range(self.topology.num_ranks)]

    def engine_options(self) -> list[dict]:
        return [self._options(self.topology.engine_slot(index)) for index in range(self.topology.num_engines)]

    def bundle_nodes(self) -> list[str]:
        """The node id each bundle landed on, by bundle index."""
        table = placement_group_table(self.group)["bundles_to_node_id"]
        return [table[index] for index in range(len(table))]

    def remove(self, timeout_s: float = 30.0) -> None:
        """Give the placement group back. Bounded: when Ray's own processes are gone (a SIGTERM
        sent to the whole process group reaches them too) the call would wait forever."""
        import threading

        if not self.owned:
            return
        remover = threading.Thread(target=remove_placement_group, args=(self.group,), daemon=True)
        remover.start()
        remover.join(timeout_s)
        if remover.is_alive():
            logger.warning("the Ray cluster did not remove the placement group within %.0fs (is Ray still "
                           "running?); going on with the shutdown", timeout_s)


def create_placement(topology: Topology, timeout_s: float = 120.0) -> Placement:
    bundles = topology.bundles()
    group = placement_group(bundles, strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise TimeoutError(
            f"Ray could not place {len(bundles)} bundles ({bundles[0]} ...) within {timeout_s:.0f}s; "
            f"cluster resources: {ray.cluster_resources()}"
        )
    return Placement(group, topology)
