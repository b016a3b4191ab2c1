"""Ray placement: which bundle each trainer rank and rollout engine runs in.

Colocated: one bundle per trainer rank; trainer rank i and engine i share bundle i (on a GPU node
they share its GPU, with fractional GPU requests). CPU runs ask for no GPUs at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


@dataclass
class ColocatedPlacement:
    group: PlacementGroup
    num_bundles: int
    has_gpu: bool

    # A trainer rank and an engine each take half of the bundle's GPU, if there is one.
    CPUS_PER_ACTOR = 1
    GPU_SHARE = 0.5

    def options(self, bundle_index: int) -> dict:
        """Ray actor options placing an actor in bundle `bundle_index`."""
        if not 0 <= bundle_index < self.num_bundles:
            raise IndexError(f"bundle {bundle_index} outside 0..{self.num_bundles - 1}")
        return {
            "num_cpus": self.CPUS_PER_ACTOR,
            "num_gpus": self.GPU_SHARE if self.has_gpu else 0,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.group, placement_group_bundle_index=bundle_index
            ),
        }

    def remove(self) -> None:
        remove_placement_group(self.group)


def create_colocated_placement(num_bundles: int, has_gpu: bool, timeout_s: float = 120.0) -> ColocatedPlacement:
    bundle = {"CPU": 2 * ColocatedPlacement.CPUS_PER_ACTOR}
    if has_gpu:
        bundle["GPU"] = 1
    group = placement_group([dict(bundle) for _ in range(num_bundles)], strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise TimeoutError(
            f"Ray could not place {num_bundles} bundles of {bundle} within {timeout_s:.0f}s; "
            f"cluster resources: {ray.cluster_resources()}"
        )
    return ColocatedPlacement(group=group, num_bundles=num_bundles, has_gpu=has_gpu)
