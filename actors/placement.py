"""Ray placement: which bundle each trainer rank and rollout engine runs in.

Colocated: one bundle per trainer rank; trainer rank i and engine i share bundle i (on a GPU node
they share its GPU, with fractional GPU requests). Disaggregated: trainers and engines own
separate bundles (separate GPUs, possibly separate nodes). CPU runs ask for no GPUs at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

CPUS_PER_ACTOR = 1


@dataclass
class Placement:
    group: PlacementGroup
    mode: str  # "colocated" | "disaggregated"
    num_ranks: int
    num_engines: int
    engine_gpus: int
    has_gpu: bool

    def _options(self, bundle: int, gpus: float) -> dict:
        return {
            "num_cpus": CPUS_PER_ACTOR,
            "num_gpus": gpus if self.has_gpu else 0,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.group, placement_group_bundle_index=bundle
            ),
        }

    def trainer_options(self, rank: int) -> dict:
        if not 0 <= rank < self.num_ranks:
            raise IndexError(f"trainer rank {rank} outside 0..{self.num_ranks - 1}")
        # Colocated: the trainer and the engine each take half of the bundle's GPU.
        return self._options(rank, 0.5 if self.mode == "colocated" else 1)

    def engine_options(self, index: int) -> dict:
        if not 0 <= index < self.num_engines:
            raise IndexError(f"engine {index} outside 0..{self.num_engines - 1}")
        if self.mode == "colocated":
            return self._options(index, 0.5)
        return self._options(self.num_ranks + index, self.engine_gpus)

    def remove(self) -> None:
        remove_placement_group(self.group)


def create_placement(mode: str, num_ranks: int, num_engines: int, engine_gpus: int, has_gpu: bool,
                     timeout_s: float = 120.0) -> Placement:
    if mode == "colocated":
        bundles = [{"CPU": 2 * CPUS_PER_ACTOR, **({"GPU": 1} if has_gpu else {})} for _ in range(num_ranks)]
    elif mode == "disaggregated":
        bundles = [{"CPU": CPUS_PER_ACTOR, **({"GPU": 1} if has_gpu else {})} for _ in range(num_ranks)]
        bundles += [{"CPU": CPUS_PER_ACTOR, **({"GPU": engine_gpus} if has_gpu else {})} for _ in range(num_engines)]
    else:
        raise ValueError(f"unknown placement mode {mode!r} (colocated or disaggregated)")
    group = placement_group(bundles, strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise TimeoutError(
            f"Ray could not place {len(bundles)} bundles ({bundles[0]} ...) within {timeout_s:.0f}s; "
            f"cluster resources: {ray.cluster_resources()}"
        )
    return Placement(group, mode, num_ranks, num_engines, engine_gpus, has_gpu)
