"""A run's components (engines, trainer ranks, their placement and the colocated hand-off):
started in order, restored from a checkpoint, kept in sync, and stopped by the caller's ExitStack
whatever happens (engines first: their servers hold shared-memory handles from the trainers).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from ray.exceptions import RayError

from rlsys.actors.group import TrainerGroup
from rlsys.actors.placement import Placement, create_placement
from rlsys.actors.trainer import TrainerSpec
from rlsys.actors.warm_ranks import warm_trainer_group
from rlsys.config import RunConfig
from rlsys.model.shape import ModelShape
from rlsys.multimodal.image_load import ImageLoad
from rlsys.rollout.manager import RolloutManager
from rlsys.run.attach import attach
from rlsys.run.checkpointing import CheckpointStore, CoordinatorState, restore_python_random_state
from rlsys.run.engine_spec import server_spec
from rlsys.run.events import RunEvents
from rlsys.run.handoff import ALL_REGIONS, DeviceHandoff
from rlsys.run.placement_checks import (
    judge_memory_plan,
    probe_placement_nodes,
    refuse_unusable_placement_nodes,
)
from rlsys.run.verify import ImageProbe, model_depth, verify_engine_weights
from rlsys.system.cluster import ACTOR_ENV
from rlsys.system.topology import Topology

logger = logging.getLogger(__name__)


@dataclass
class Components:
    topology: Topology
    placement: Placement
    rollout: RolloutManager | None = None
    trainer: TrainerGroup | None = None
    handoff: DeviceHandoff | None = None
    cpu_sharers: tuple[int, int] = (1, 1)  # (trainer, engine): Topology.cpu_sharers on this placement
    events: RunEvents | None = None  # what the components report to (hangs, restarts), given to each at construction

    def shutdown(self) -> None:
        """Stop whatever has started: engines, then trainer ranks, then the placement group."""
        if self.rollout is not None:
            self.rollout.shutdown()
        if self.trainer is not None:
            self.trainer.shutdown()
        self.placement.remove()


def start_components(config: RunConfig, topology: Topology, run_dir: Path, stack: ExitStack,
                     events: RunEvents | None = None, images: ImageLoad | None = None) -> Components:
    """Engines start in the background while the trainer ranks build their models (on GPUs,
    colocated, the engines first: `Topology.engines_start_first`); then each rank is connected to
    the engine(s) it feeds. `stack` stops them, whatever happens. `events`: what they report to;
    `images`: the training prompts' image load, for the memory plan."""
    start = time.perf_counter()
    attached = None
    if config.rollout.attach:  # standing engines: checked and leased before any trainer starts
        attached = attach(config, topology, run_dir, "train")
        stack.callback(attached.lease.release)  # after the components stop (the engines are left ready first)
    parts = Components(topology, attached.placement if attached else create_placement(topology), events=events)
    stack.callback(parts.shutdown)
    # Before any trainer or engine starts; the memory plan, on rank 0's reading of the model, before
    # the ranks build it (`_trainer_group`).
    nodes = probe_placement_nodes(config, topology, parts.placement, run_dir)
    refuse_unusable_placement_nodes(config, nodes, run_dir)
    parts.cpu_sharers = topology.cpu_sharers(parts.placement.bundle_nodes())
    if config.placement.env:
        logger.info("placement.env of the trainer ranks and engine servers: %s",
                    " ".join(f"{name}={value}" for name, value in sorted(config.placement.env.items())))
    server = server_spec(config, topology, parts.cpu_sharers[1])
    parts.rollout = RolloutManager.start(server, topology.num_engines, str(run_dir / "logs"),
                                   parts.placement.engine_options(), standing=attached.record if attached else None,
                                   hangs_dir=str(run_dir / "hangs"), events=events)
    if topology.engines_start_first:
        parts.rollout.fleet.wait_ready()
    parts.trainer = _trainer_group(config, parts, partial(judge_memory_plan, config, topology, nodes, images=images))
    ranks = parts.trainer.describe()
    logger.info(f"trainer: {topology.num_ranks} ranks on {ranks['device']} ({ranks['layout']}, {ranks['dist_backend']}, "
                f"{ranks['attention']} attention, {ranks['compute_dtype']} compute, {ranks['threads']} CPU threads "
                f"each{'' if ranks['context_parallel'] == 'off' else ', context parallel: ' + ranks['context_parallel']}"
                f"{'' if ranks.get('reference') is None else ', reference on the ' + ranks['reference']})"
                f" ready after {time.perf_counter() - start:.1f} s")
    parts.topology = topology.with_engines(parts.rollout.fleet.wait_ready())
    logger.info("%d SGLang engine(s) ready after %.1f s", topology.num_engines, time.perf_counter() - start)
    parts.trainer.connect_engines(parts.topology, config.weight_sync.timeout_s)
    parts.handoff = DeviceHandoff(parts.trainer, parts.rollout.fleet, topology.trainers_sleep,
                                  run_dir / "logs" / "device_handoff.jsonl")
    return parts


def _trainer_group(config: RunConfig, parts: Components,
                   judge_model: Callable[[ModelShape], bool | None] | None = None,
                   reference_on_device: bool | None = None) -> TrainerGroup:
    """The trainer ranks; `reference_on_device`: where an earlier group of this run had its reference
    model (the memory plan's choice, kept by a restarted group)."""
    spec = TrainerSpec.from_config(config, parts.topology.has_gpu, cpu_sharers=parts.cpu_sharers[0])
    if reference_on_device is not None:
        spec = replace(spec, reference_on_device=reference_on_device)
    standing = parts.rollout.fleet.standing if parts.rollout is not None else None
    if standing is not None and standing.warm_trainers:  # the ranks the set keeps (actors/warm_ranks.py)
        return warm_trainer_group(standing.name, spec, parts.topology.num_ranks, parts.placement.trainer_options(),
                                  trainer_env(config), judge_model, parts.events)
    return TrainerGroup(spec, parts.topology.num_ranks, parts.placement.trainer_options(),
                        env_vars=trainer_env(config), judge_model=judge_model, events=parts.events)


def trainer_env(config: RunConfig) -> dict[str, str]:
    """The trainer ranks' environment: one BLAS thread to start with (TrainerSpec.threads sets the
    count), and the run's placement.env (NCCL and gloo settings), which the engines' servers get too."""
    return {**ACTOR_ENV, **config.placement.env}


def restart_trainers(config: RunConfig, parts: Components) -> None:
    """A fresh trainer group in the same placement slots (a rank died); load a checkpoint next."""
    placed = parts.trainer.spec.reference_on_device
    parts.trainer.shutdown()
    parts.trainer = parts.handoff.trainer = _trainer_group(config, parts, reference_on_device=placed)
    parts.trainer.connect_engines(parts.topology, config.weight_sync.timeout_s)


def bring_engines_up_to_date(config: RunConfig, parts: Components, weight_version: int) -> None:
    """After an engine restart: reconnect the trainer ranks to the engines' new addresses and
    push the trainer's weights with `weight_version` (waking a sleeping trainer for it)."""
    parts.topology = parts.topology.with_engines(parts.rollout.fleet.addresses)
    parts.trainer.connect_engines(parts.topology, config.weight_sync.timeout_s)
    asleep = parts.trainer.asleep
    if asleep:
        parts.handoff.to_trainer()
    push_weights(config, parts, weight_version)
    if asleep:
        parts.handoff.to_engines()


def sync_engines(config: RunConfig, parts: Components, weight_version: int) -> dict:
    """`push_weights`, restarting any engine that died meanwhile and pushing again."""
    try:
        return push_weights(config, parts, weight_version)
    except RayError as error:
        if parts.events is not None:  # where every process was, before a stuck engine is stopped and restarted
            cause = str(getattr(error, "cause", None) or error).strip().splitlines()
            parts.events.collect_stacks(f"weight sync to version {weight_version} failed: "
                                        f"{cause[-1] if cause else error}")
        dead = parts.rollout.fleet.dead_engines()
        if not dead:
            raise
        for index in dead:
            parts.rollout.fleet.restart(index, f"it died during a weight sync: {getattr(error, 'cause', None) or error}")
        return push_weights(config, parts, weight_version)


def push_weights(config: RunConfig, parts: Components, weight_version: int) -> dict:
    """Trainer -> engines over the topology's transport; then, with weight_sync.verify, check
    that every engine computes what the trainer computes. Returns the sync's metrics: the bytes
    handed to the engines (every rank with a transport), and their rate over the sync's time."""
    parts.handoff.weights_to_engines()
    ranks = parts.trainer.sync_weights(int(config.weight_sync.bucket_size_mb * 2**20), weight_version,
                                       config.weight_sync.pipelined)
    sent = sum(rank["bytes"] for rank in ranks)
    seconds = max(rank["total_s"] for rank in ranks)
    metrics = {"sync_bytes": sent, "sync_gbps": sent / seconds / 1e9 if seconds > 0 else 0.0,
               "sync_buckets": max(rank["buckets"] for rank in ranks)}
    if config.weight_sync.verify:
        # The probes need the engines' KV cache: back beside the awake trainer (a debugging aid,
        # it costs the memory that the hand-off otherwise saves).
        parts.rollout.fleet.resume_memory(list(ALL_REGIONS))
        verify_engine_weights(parts.trainer, parts.rollout.fleet, weight_version, config.weight_sync.verify_tolerance,
                              config.seed, config.model.dtype, model_depth(config.model.path),
                              ImageProbe.of(config.model.path))
    return metrics


def restore(config: RunConfig, parts: Components, checkpoint: Path | None) -> CoordinatorState:
    """Load the trainer from `checkpoint` and bring the engines to the same weights and version."""
    if checkpoint is None:
        if parts.rollout.fleet.standing is not None:
            # Standing engines hold whatever the last run left: this run's weights, as version 0,
            # and its seed's random stream (else what it samples depends on the runs before it).
            push_weights(config, parts, 0)
            parts.rollout.fleet.restart_random_streams(config.seed)
        return CoordinatorState(next_step=0, weight_version=0, data_epoch=0, data_index=0)
    state = CheckpointStore.load_state(checkpoint)
    parts.trainer.load_checkpoint(str(checkpoint))
    push_weights(config, parts, state.weight_version)
    restore_python_random_state(state.python_random_state)
    return state
