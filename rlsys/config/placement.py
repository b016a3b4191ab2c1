"""placement: where the trainer ranks and the engines run."""

from __future__ import annotations

import re
from typing import Literal

import yaml
from pydantic import Field, field_validator

from rlsys.section import Section

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


# What placement.env may not replace: each is chosen per process, and a run-wide value would break it.
_ENV_SET_BY_RLSYS = {
    "CUDA_VISIBLE_DEVICES": "Ray for each actor (the GPUs of its placement bundle)",
    "OMP_NUM_THREADS": "rlsys from the cores each process shares (TrainerSpec.threads, ServerSpec.threads)",
    "MKL_NUM_THREADS": "rlsys from the cores each process shares (TrainerSpec.threads, ServerSpec.threads)",
    "MASTER_ADDR": "rlsys from the trainer ranks' rendezvous",
    "MASTER_PORT": "rlsys from the trainer ranks' rendezvous",
    "RANK": "torch.distributed for each rank",
    "WORLD_SIZE": "torch.distributed for each rank",
}


class PlacementConfig(Section):
    mode: Literal["colocated", "disaggregated"] = Field(
        "colocated", description="colocated: engine i shares trainer rank i's device; disaggregated: trainers "
        "and engines on separate resources.",
    )
    ray_address: str | None = Field(None, description="Ray cluster address; a local cluster when unset.")
    num_cpus: int | None = Field(None, ge=1, description="Logical CPUs for a local Ray cluster.")
    device: Literal["auto", "cuda", "cpu"] = Field(
        "auto", description="auto: GPUs when the Ray cluster has any (decided from the cluster's resources, not the "
        "driver's); cuda: fail unless the cluster has the GPUs the placement needs; cpu: never use GPUs.",
    )
    gpu_memory_gb: float | None = Field(
        None, gt=0, description="Memory of one GPU that the memory plan checks against; default: `rlsys train` "
        "reads the smallest GPU (or, on a CPU run, the RAM) of the nodes its placement got; `rlsys plan` the GPUs "
        "of the Ray cluster at placement.ray_address (or RAY_ADDRESS) when it has any, else this machine's GPU; "
        "needed by `rlsys plan` for placement.device=cuda on a machine that can read neither.",
    )
    trainer_node_resources: dict[str, float] = Field(
        default_factory=dict, description="Ray custom resources each trainer rank's bundle also asks for, to keep "
        "trainers on the nodes that offer them (`ray start --resources='{\"train_node\": 8}'`; KubeRay: "
        "rayStartParams.resources). Colocated bundles ask for both sections' resources.",
    )
    engine_node_resources: dict[str, float] = Field(
        default_factory=dict, description="Ray custom resources each engine's bundle also asks for (see "
        "trainer_node_resources).",
    )

    env: dict[str, str] = Field(
        default_factory=dict, description="Environment variables of every trainer rank and every engine's SGLang "
        "server, where the collectives run: NCCL_DEBUG, NCCL_SOCKET_IFNAME, NCCL_IB_HCA, NCCL_IB_DISABLE, "
        "TORCH_NCCL_*, GLOO_SOCKET_IFNAME (which then replaces the interface rlsys picks), ... Numbers and true/false "
        "are passed as YAML spells them. Standing engines keep the env of `rlsys engines up`.",
    )

    @field_validator("env", mode="before")
    @classmethod
    def _env_values_as_text(cls, env):
        if isinstance(env, dict):
            return {name: yaml.safe_dump(value).splitlines()[0] if isinstance(value, bool | int | float) else value
                    for name, value in env.items()}
        return env

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        for name in env:
            if not _ENV_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not an environment variable name (letters, digits and _)")
            if name in _ENV_SET_BY_RLSYS:
                raise ValueError(f"{name} is set by {_ENV_SET_BY_RLSYS[name]}; placement.env cannot replace it")
        return env

    @field_validator("trainer_node_resources", "engine_node_resources")
    @classmethod
    def _positive_amounts(cls, resources: dict[str, float]) -> dict[str, float]:
        reserved = {"CPU", "GPU", "memory", "object_store_memory"}
        for name, amount in resources.items():
            if name in reserved:
                raise ValueError(f"{name} is set by the placement itself; name a custom resource")
            if amount <= 0:
                raise ValueError(f"resource {name} must be > 0 (got {amount})")
        return resources
