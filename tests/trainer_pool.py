"""Trainer groups kept warm for the trainer tests of make test's second stream (tests/conftest.py: `trainer_pool`,
`warm_trainer_groups`).

A rank's start is a process importing torch and transformers, ~10 CPU-seconds on these machines,
and the trainer tests ask for ~45 short-lived ranks: a group a test is done with stays up and is
rebuilt for the next test's spec (`InspectableTrainerGroup.rebuild`: models, optimizer, schedule,
context-parallel groups and seeded RNG all the new spec's), so those tests start ~17 ranks instead.
A test that measures a process's memory (a load's peak, a leak) starts its own group.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from rlsys.actors.inspectable_group import InspectableTrainerGroup
from rlsys.actors.trainer import TrainerSpec

# Idle ranks kept at most (each holds ~0.4 GB of imports): the largest groups are let go first.
MAX_IDLE_RANKS = 8


def _rebuilt(group: InspectableTrainerGroup, spec: TrainerSpec) -> InspectableTrainerGroup:
    group.rebuild(spec)
    return group


class TrainerPool:
    def __init__(self, max_idle_ranks: int = MAX_IDLE_RANKS):
        self.max_idle_ranks = max_idle_ranks
        self.idle: list[InspectableTrainerGroup] = []

    def take(self, *wanted: tuple[TrainerSpec, int]) -> list[InspectableTrainerGroup]:
        """Groups for (spec, num_ranks) pairs, all made at once: an idle group of that many ranks
        rebuilt for the spec where the pool has one, a new group where not. If any fails, every
        group of the call is shut down and the error raised."""
        plan = []
        for spec, num_ranks in wanted:
            idle = next((group for group in self.idle if group.num_ranks == num_ranks), None)
            if idle is not None:
                self.idle.remove(idle)
            plan.append((spec, num_ranks, idle))
        with ThreadPoolExecutor(len(plan)) as threads:
            making = [threads.submit(_rebuilt, idle, spec) if idle is not None else
                      threads.submit(InspectableTrainerGroup, spec, num_ranks) for spec, num_ranks, idle in plan]
        made = [future.result() for future in making if future.exception() is None]
        failed = [future.exception() for future in making if future.exception() is not None]
        if failed:
            for group in made + [idle for _, _, idle in plan if idle is not None and idle not in made]:
                group.shutdown()
            raise failed[0]
        return made

    def give_back(self, groups: list[InspectableTrainerGroup], healthy: bool) -> None:
        """Groups a test is done with: kept for the next test if the test passed (`healthy`) and the
        pool has room, else shut down. A group its test shut down already is let go."""
        for group in groups:
            if not group.workers:
                continue
            if healthy and not group.hung:
                self.idle.append(group)
            else:
                group.shutdown()
        self.idle.sort(key=lambda group: group.num_ranks)
        while sum(group.num_ranks for group in self.idle) > self.max_idle_ranks:
            self.idle.pop().shutdown()

    def close(self) -> None:
        for group in self.idle:
            group.shutdown()
        self.idle = []
