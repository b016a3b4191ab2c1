"""Whether the nodes a placement got can run the config (and `rlsys doctor`, the same code): each
sees run_dir and the model, checked before any trainer or engine starts; its devices fit the memory
plan, judged on the model's shapes as trainer rank 0 reports them before the ranks build their
models (`rlsys train`; `rlsys doctor` and `rlsys engines up` read the shapes in their own process);
and whether the run uses GPUs, from the Ray cluster's resources."""

from __future__ import annotations

import logging
from pathlib import Path

from rlsys.actors.placement import Placement
from rlsys.config import RunConfig
from rlsys.errors import RunFailed
from rlsys.model.checks import model_report
from rlsys.model.shape import ModelShape
from rlsys.multimodal.image_load import ImageLoad
from rlsys.plan.memory_plan import plan_for_devices
from rlsys.system.backend import BackendError, cluster_gpus, decide_has_gpu
from rlsys.system.node import node_address
from rlsys.system.node_checks import (
    HubSnapshot,
    NodeReport,
    PlacementNodes,
    device_memory_budget,
    probe_nodes,
    refuse_unusable_nodes,
)
from rlsys.system.topology import Topology

logger = logging.getLogger(__name__)


def check_placement_nodes(config: RunConfig, topology: Topology, placement: Placement, run_dir: Path) -> None:
    """Every node the placement got sees run_dir and the model, and its devices fit the memory plan
    (rlsys/system/node_checks.py); otherwise a ConfigError naming the node and what to set."""
    judge_placement_nodes(config, topology, probe_placement_nodes(config, topology, placement, run_dir), run_dir)


def refuse_unusable_placement_nodes(config: RunConfig, reports: list[NodeReport], run_dir: Path | None) -> None:
    """NodeCheckFailed (a ConfigError) for a node that cannot see run_dir or the model."""
    refuse_unusable_nodes(reports, run_dir, model_paths(config))


def model_paths(config: RunConfig) -> tuple[str, ...]:
    """The directories every node that loads the model must see: the model's, and a separate tokenizer's."""
    engine = config.rollout.engine
    return (config.model.path,) + ((config.model.tokenizer_path,)
                                   if config.model.tokenizer_path and not engine.skip_tokenizer_init else ())


def probe_placement_nodes(config: RunConfig, topology: Topology, placement: Placement,
                          run_dir: Path | None) -> list[NodeReport]:
    """Each node of the placement's report (rlsys/system/node_checks.py), naming the roles it holds;
    `rlsys doctor` asks the same."""
    bundle_nodes = placement.bundle_nodes()
    placed = PlacementNodes()
    for bundle, roles in sorted(topology.roles_by_bundle().items()):
        for role in roles:
            placed.add(bundle_nodes[bundle], role)
    hub = ((HubSnapshot(config.model.hub_id, config.model.revision, config.model.path),)
           if config.model.hub_id and config.model.revision else ())
    return probe_nodes(placed, run_dir, model_paths(config), hub)


def judge_placement_nodes(config: RunConfig, topology: Topology, reports: list[NodeReport],
                          run_dir: Path | None) -> None:
    """NodeCheckFailed (a ConfigError) for a node that cannot see run_dir or the model, ConfigError
    when the trainer cannot load the model or the memory plan does not fit the nodes' devices (the
    model's shapes read in this process); logs the plan and the nodes."""
    refuse_unusable_placement_nodes(config, reports, run_dir)
    judge_memory_plan(config, topology, reports, model_report(config.model.path, config.model.lora))


def judge_memory_plan(config: RunConfig, topology: Topology, reports: list[NodeReport], shape: ModelShape,
                      images: ImageLoad | None = None) -> bool | None:
    """ConfigError when the memory plan of a model of `shape` (trained on prompts whose images take
    `images` of a micro-batch) does not fit the nodes' devices; logs the plan and the nodes. Returns
    where the plan put the reference model (True: on the device; None: the run has none of its own)."""
    memory, source = device_memory_budget(reports, topology.has_gpu)
    trainer_nodes = [r for r in reports if any(role.startswith("trainer") for role in r.roles)]
    flash = (topology.has_gpu and config.model.dtype in ("bfloat16", "float16")
             and all(r.flash_attn_installed for r in trainer_nodes))
    plan = plan_for_devices(config, shape, topology.has_gpu, memory, flash, images)
    budget = "placement.gpu_memory_gb" if config.placement.gpu_memory_gb is not None else source
    logger.info("memory plan: peak %.2f GiB per device of %.1f GiB (%s; rlsys plan CONFIG for every term)",
                plan.per_gpu_bytes / 2**30, plan.gpu_memory_bytes / 2**30, budget)
    driver = node_address()
    if len(reports) > 1 or reports[0].address != driver:
        logger.info("nodes: driver %s; %s", driver, "; ".join(f"{r.address}: {', '.join(r.roles)}" for r in reports))
    if plan.reference_on_device is not None:
        logger.info("reference model: fp32 shards on the %s (trainer.reference_placement=%s)",
                    "device" if plan.reference_on_device else "host", config.trainer.reference_placement)
    return plan.reference_on_device


def run_uses_gpus(config: RunConfig, layout: Topology) -> bool:
    """From the Ray cluster's resources: the driver may sit on a GPU-less head node."""
    try:
        has_gpu = decide_has_gpu(config.placement.device, cluster_gpus(), layout.gpus_needed())
    except BackendError as error:
        raise RunFailed(str(error)) from None
    logger.info("%s (placement.device=%s, %g GPUs in the Ray cluster)", "GPUs" if has_gpu else "CPUs only",
                config.placement.device, cluster_gpus())
    return has_gpu
