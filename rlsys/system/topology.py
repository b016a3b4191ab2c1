"""Who runs where and who feeds whom, decided once from the config; nothing else tests the mode.

Colocated: bundle i holds trainer rank i and engine i (on a GPU node they share its GPU, half each);
rank i hands its weights to engine i by IPC handle; ranks beyond the last engine only join the
gathers; on GPUs trainers sleep between train phases so the engines get the device. Disaggregated:
trainers and engines own separate bundles (separate GPUs, possibly nodes), trainer rank 0
broadcasts to every engine, and the trainers never sleep. Pure: computable without Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from rlsys.config import RunConfig

CPUS_PER_ACTOR = 1


@dataclass(frozen=True)
class EngineAddress:
    """Where an engine answers, and its log file (for error messages)."""

    name: str  # "engine-0"
    url: str
    log_path: str = ""
    tp_size: int = 1
    api_key: str | None = field(default=None, repr=False)  # sent as a bearer token; never printed

    def __str__(self) -> str:
        return f"SGLang server {self.name} ({self.url})"

    @property
    def host(self) -> str:
        """The node address the server listens on."""
        from urllib.parse import urlparse

        return urlparse(self.url).hostname or ""


@dataclass(frozen=True)
class Slot:
    """Where an actor goes: a placement-group bundle and the share of its GPUs it asks for."""

    bundle: int
    gpus: float


@dataclass(frozen=True)
class Topology:
    mode: Literal["colocated", "disaggregated"]
    num_ranks: int
    num_engines: int
    engine_tp_size: int
    has_gpu: bool
    trainers_sleep: bool  # offload to host between train phases, giving the device to the engines
    engines: tuple[EngineAddress, ...] = ()  # known once the engines answer: `with_engines`
    # Ray custom resources a trainer's / an engine's bundle also asks for (placement.*_node_resources).
    trainer_resources: dict[str, float] = field(default_factory=dict, hash=False)
    engine_resources: dict[str, float] = field(default_factory=dict, hash=False)

    @classmethod
    def from_config(cls, config: RunConfig, has_gpu: bool) -> Topology:
        colocated = config.placement.mode == "colocated"
        return cls(
            mode=config.placement.mode, num_ranks=config.trainer.num_ranks,
            num_engines=config.rollout.num_engines, engine_tp_size=config.rollout.engine.tp_size,
            has_gpu=has_gpu, trainers_sleep=config.trainer.sleeps_between_steps(colocated, has_gpu),
            trainer_resources=dict(config.placement.trainer_node_resources),
            engine_resources=dict(config.placement.engine_node_resources),
        )

    def __post_init__(self):
        if self.mode not in ("colocated", "disaggregated"):
            raise ValueError(f"unknown placement mode {self.mode!r} (colocated or disaggregated)")
        if self.mode == "colocated" and self.num_engines > self.num_ranks:
            raise ValueError(f"colocated placement needs an engine per trainer rank at most "
                             f"({self.num_engines} engines, {self.num_ranks} ranks)")
        if self.mode == "colocated" and self.engine_tp_size != 1:
            raise ValueError("colocated placement shares one GPU per trainer rank and engine: engine tp_size must be 1")

    @property
    def engines_start_first(self) -> bool:
        """Colocated on GPUs: an engine sizes its KV cache from the GPU memory free when it starts,
        so the trainer ranks build their models only once the engines are up. On CPU (no device
        to share) both start side by side."""
        return self.mode == "colocated" and self.has_gpu

    @property
    def transport(self) -> Literal["ipc", "broadcast"]:
        return "ipc" if self.mode == "colocated" else "broadcast"

    # ---- placement ----------------------------------------------------------------------
    def bundles(self) -> list[dict[str, float]]:
        """Ray resources of each placement-group bundle, trainers' first."""
        if self.mode == "colocated":
            both = _sum_resources(self.trainer_resources, self.engine_resources)
            return [self._bundle(2 * CPUS_PER_ACTOR, 1, both) for _ in range(self.num_ranks)]
        return ([self._bundle(CPUS_PER_ACTOR, 1, self.trainer_resources) for _ in range(self.num_ranks)]
                + [self._bundle(CPUS_PER_ACTOR, self.engine_tp_size, self.engine_resources)
                   for _ in range(self.num_engines)])

    def custom_resources(self) -> dict[str, float]:
        """The custom resources all bundles ask for together (what a local cluster must offer)."""
        totals: dict[str, float] = {}
        for bundle in self.bundles():
            totals = _sum_resources(totals, {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")})
        return totals

    def gpus_needed(self) -> int:
        """GPUs the placement takes when the run uses GPUs: one per colocated trainer/engine pair;
        disaggregated, one per trainer rank plus tp_size per engine."""
        if self.mode == "colocated":
            return self.num_ranks
        return self.num_ranks + self.num_engines * self.engine_tp_size

    def _bundle(self, cpus: int, gpus: int, resources: dict[str, float]) -> dict[str, float]:
        return {"CPU": cpus, **({"GPU": gpus} if self.has_gpu else {}), **resources}

    def trainer_slot(self, rank: int) -> Slot:
        if not 0 <= rank < self.num_ranks:
            raise IndexError(f"trainer rank {rank} outside 0..{self.num_ranks - 1}")
        return Slot(rank, self._gpus(0.5 if self.mode == "colocated" else 1))

    def engine_slot(self, index: int) -> Slot:
        if not 0 <= index < self.num_engines:
            raise IndexError(f"engine {index} outside 0..{self.num_engines - 1}")
        if self.mode == "colocated":
            return Slot(index, self._gpus(0.5))
        return Slot(self.num_ranks + index, self._gpus(self.engine_tp_size))

    def _gpus(self, gpus: float) -> float:
        return gpus if self.has_gpu else 0

    def cpu_sharers(self, bundle_nodes: list[str]) -> tuple[int, int]:
        """(trainer, engine): how many of the run's processes compute at once on the busiest node
        while a trainer rank trains, and while an engine generates; each divides its node's cores
        by this. Colocated, the phases take turns, so a phase's processes have the node to
        themselves; disaggregated, each side keeps its own share (an engine counts tp_size)."""
        trainers, engines = {}, {}
        for rank in range(self.num_ranks):
            node = bundle_nodes[self.trainer_slot(rank).bundle]
            trainers[node] = trainers.get(node, 0) + 1
        for index in range(self.num_engines):
            node = bundle_nodes[self.engine_slot(index).bundle]
            engines[node] = engines.get(node, 0) + self.engine_tp_size
        if self.mode == "colocated":
            return max(trainers.values()), max(engines.values())
        busiest = {node: trainers.get(node, 0) + engines.get(node, 0) for node in {*trainers, *engines}}
        return (max(busiest[node] for node in trainers), max(busiest[node] for node in engines))

    def local_cpus(self) -> int:
        """Logical CPUs a local Ray cluster needs: one per actor slot, and a spare."""
        return sum(bundle["CPU"] for bundle in self.bundles()) + 1

    # ---- weight sync --------------------------------------------------------------------
    def engine_fed_by(self, rank: int) -> int | None:
        """The engine that trainer `rank` hands its weights to by IPC (colocated), if any."""
        return rank if self.mode == "colocated" and rank < self.num_engines else None

    @property
    def gather_dst(self) -> int | None:
        """The one rank that needs full tensors, when only one does (it broadcasts, or feeds the
        only engine): the other ranks then send it their shards instead of all-gathering."""
        if self.mode == "disaggregated" or self.num_engines == 1:
            return 0
        return None

    def roles_by_bundle(self) -> dict[int, list[str]]:
        """Bundle index -> what it holds ("trainer rank 0", "engine-1"), for messages."""
        roles: dict[int, list[str]] = {}
        for rank in range(self.num_ranks):
            roles.setdefault(self.trainer_slot(rank).bundle, []).append(f"trainer rank {rank}")
        for index in range(self.num_engines):
            roles.setdefault(self.engine_slot(index).bundle, []).append(f"engine-{index}")
        return roles

    def with_engines(self, engines: list[EngineAddress]) -> Topology:
        if len(engines) != self.num_engines:
            raise ValueError(f"{len(engines)} engine addresses for {self.num_engines} engines")
        return replace(self, engines=tuple(engines))


def _sum_resources(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {name: a.get(name, 0) + b.get(name, 0) for name in {*a, *b}}
