"""A run's components: started in order, restored from a checkpoint, and stopped by the caller's
ExitStack whatever happens (engines first: their servers hold shared-memory handles from the
trainers)."""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from rlsys.actors.group import TrainerGroup
from rlsys.actors.placement import Placement, create_placement
from rlsys.actors.trainer import TrainerSpec
from rlsys.checkpointing import CheckpointStore, CoordinatorState, restore_python_random_state
from rlsys.cluster import ACTOR_ENV
from rlsys.config import RunConfig
from rlsys.rollout.manager import RolloutManager
from rlsys.rollout.server import ServerSpec
from rlsys.topology import Topology
from rlsys.verify import verify_engine_weights


@dataclass
class Components:
    topology: Topology
    placement: Placement
    rollout: RolloutManager | None = None
    trainer: TrainerGroup | None = None

    def shutdown(self) -> None:
        """Stop whatever has started: engines, then trainer ranks, then the placement group."""
        if self.rollout is not None:
            self.rollout.shutdown()
        if self.trainer is not None:
            self.trainer.shutdown()
        self.placement.remove()


def start_components(config: RunConfig, topology: Topology, run_dir: Path, stack: ExitStack) -> Components:
    """Engines start in the background while the trainer ranks build their models; then each
    rank is connected to the engine(s) it feeds. `stack` stops them, whatever happens."""
    parts = Components(topology, create_placement(topology))
    stack.callback(parts.shutdown)
    parts.rollout = RolloutManager(ServerSpec(config.model, config.rollout.engine, config.seed),
                                   topology.num_engines, str(run_dir / "logs"), parts.placement.engine_options())
    parts.trainer = TrainerGroup(TrainerSpec.from_config(config), topology.num_ranks,
                                 parts.placement.trainer_options(), env_vars=ACTOR_ENV)
    parts.topology = topology.with_engines(parts.rollout.wait_ready())
    parts.trainer.connect_engines(parts.topology, config.weight_sync.timeout_s)
    return parts


def push_weights(config: RunConfig, parts: Components, weight_version: int) -> None:
    """Trainer -> engines over the topology's transport; then, with weight_sync.verify, check
    that every engine computes what the trainer computes."""
    parts.trainer.sync_weights(int(config.weight_sync.bucket_size_mb * 2**20), weight_version)
    if config.weight_sync.verify:
        tolerance = config.weight_sync.verify_tolerance or (1e-3 if config.model.dtype == "float32" else 5e-2)
        verify_engine_weights(parts.trainer, parts.rollout, weight_version, tolerance, config.seed)


def restore(config: RunConfig, parts: Components, checkpoint: Path | None) -> CoordinatorState:
    """Load the trainer from `checkpoint` and bring the engines to the same weights and version."""
    if checkpoint is None:
        return CoordinatorState(next_step=0, weight_version=0, data_epoch=0, data_index=0)
    state = CheckpointStore.load_state(checkpoint)
    parts.trainer.load_checkpoint(str(checkpoint))
    push_weights(config, parts, state.weight_version)
    restore_python_random_state(state.python_random_state)
    return state
