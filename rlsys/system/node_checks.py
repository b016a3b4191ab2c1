"""What every node the placement landed on must offer, checked before any trainer or engine starts.

- **Shared run directory.** Trainer ranks write their checkpoint shards, and engines their logs,
  into `run_dir` from their own nodes, and the driver renames the checkpoint into place from its
  own: that only works on storage every node sees at the same path. The driver writes a file
  with a fresh token into `run_dir`; each node must read that token back and be able to create
  (and remove) a file there. A node-local path (or a relative one, which resolves inside each
  node's own copy of the job's working directory) fails this on every other node.
- **The model** at `model.path` (and the tokenizer, if separate) on every node that loads it. A
  model given as a hub id (rlsys/system/model_source.py) is resolved on the node at the driver's
  commit first, downloaded into the node's hub cache when the node is online and lacks it, and
  must land at the driver's path.
- **Device memory**, the memory plan's budget: the smallest GPU (NVML: every GPU of the node,
  whatever CUDA_VISIBLE_DEVICES says) of the nodes holding the run's bundles, or their RAM on a
  CPU run; and whether flash-attn can run there, asked as the trainer ranks ask it
  (rlsys/system/backend.py: flash_attn_available; False on a node without GPUs). Never the driver's
  own devices: under `ray job submit` the driver usually sits on a head without GPUs.

The same probe also reads what `rlsys doctor` (rlsys/doctor/examine.py) reports beside these checks:
CPUs, the size of /dev/shm, each GPU (NVML), and the versions of the packages a run imports.
`rlsys train` only refuses on the checks above; the doctor judges the rest too.

Nodes other than the driver's run their part in a zero-CPU Ray task pinned to the node (it fits
on any node, busy or not); the driver's own node answers in-process.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import secrets
import shutil
import socket
from dataclasses import dataclass, field
from pathlib import Path

from rlsys.config import ConfigError
from rlsys.system.backend import flash_attn_available

MARKER_PREFIX = ".rlsys-shared-check-"
# The distributions whose versions must agree across a run's nodes (ray refuses a mismatch itself,
# torch and sglang pickle tensors and requests between nodes; flash-attn changes the trainer's numerics).
PACKAGES = ("torch", "sglang", "transformers", "flash_attn", "ray")


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as NVML reports it (every GPU of the node, whatever CUDA_VISIBLE_DEVICES says)."""

    index: int
    name: str
    memory_bytes: int
    compute_mode: str  # "default", "exclusive_process", "prohibited"
    driver: str
    cuda: str  # the CUDA version the driver supports, e.g. "13.0"


@dataclass(frozen=True)
class NodeReport:
    node_id: str
    address: str
    hostname: str
    roles: tuple[str, ...]  # "trainer rank 0", "engine-1", ...
    run_dir_problem: str | None  # None: it sees the driver's files and can write beside them
    model_problem: str | None
    host_memory_bytes: int
    gpu_memory_bytes: int | None  # the node's smallest GPU (NVML); None without GPUs
    flash_attn_installed: bool
    cpus: int = 0
    shm_total_bytes: int = 0  # /dev/shm on this node (0: none)
    shm_free_bytes: int = 0
    gpus: tuple[GpuInfo, ...] = ()
    versions: dict[str, str | None] = field(default_factory=dict)  # PACKAGES (None: not installed) + python

    def describe(self) -> str:
        return f"node {self.address} ({self.hostname}; {', '.join(self.roles)})"


class NodeCheckFailed(ConfigError):
    """A node cannot run its part of the run as configured; the message names it and what to set."""


@dataclass(frozen=True)
class HubSnapshot:
    """A model the driver resolved from a hub id: where its snapshot of `commit` lies on the driver."""

    repo_id: str
    commit: str
    path: str


def probe_this_node(run_dir: str | None, marker: str, token: str, model_paths: tuple[str, ...], node_id: str,
                    roles: tuple[str, ...], hub: tuple[HubSnapshot, ...] = ()) -> NodeReport:
    """This node's part of the checks (runs on the node)."""
    import psutil

    from rlsys.system.node import node_address

    gpus = read_gpus()
    gpu_memory_bytes = min((gpu.memory_bytes for gpu in gpus), default=None)
    shm_total, shm_free = _shm_bytes()
    return NodeReport(
        node_id=node_id, address=node_address(), hostname=socket.gethostname(), roles=roles,
        run_dir_problem=_run_dir_problem(Path(run_dir), marker, token) if run_dir else None,
        model_problem=_model_problem(model_paths, hub),
        host_memory_bytes=int(psutil.virtual_memory().total),
        gpu_memory_bytes=gpu_memory_bytes,
        # Ray (2.60) leaves a zero-GPU task's CUDA_VISIBLE_DEVICES alone, so this probe sees the node's
        # GPUs as a rank would; a node without GPUs runs no flash-attn (nor imports torch to say so).
        flash_attn_installed=gpu_memory_bytes is not None and flash_attn_available(),
        cpus=os.cpu_count() or 0, shm_total_bytes=shm_total, shm_free_bytes=shm_free, gpus=gpus,
        versions=package_versions(),
    )


def package_versions() -> dict[str, str | None]:
    """The installed version of each of PACKAGES (None: not installed) and of Python, read from
    the distributions' metadata (importing them would take seconds)."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def _shm_bytes(path: str = "/dev/shm") -> tuple[int, int]:
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return 0, 0
    return usage.total, usage.free


def _run_dir_problem(run_dir: Path, marker: str, token: str) -> str | None:
    try:
        seen = (run_dir / marker).read_text()
    except FileNotFoundError:
        return "does not see the driver's files there (a different directory on this node)"
    except OSError as error:
        return f"cannot read it: {error}"
    if seen != token:
        return "sees another run's check file there (a different directory on this node)"
    probe = run_dir / f"{MARKER_PREFIX}{socket.gethostname()}-{os.getpid()}"
    try:
        probe.write_text(token)
        probe.unlink()
    except OSError as error:
        return f"cannot write there: {error}"
    return None


def _model_problem(paths: tuple[str, ...], hub: tuple[HubSnapshot, ...] = ()) -> str | None:
    for snapshot in hub:
        if not (Path(snapshot.path) / "config.json").is_file():
            problem = _fetch_snapshot(snapshot)
            if problem:
                return problem
    for path in paths:
        if not (Path(path) / "config.json").is_file():
            return f"{path} has no config.json on this node"
    return None


def _fetch_snapshot(snapshot: HubSnapshot) -> str | None:
    """Resolve the hub id on this node the driver's way, at the driver's commit (downloading when online)."""
    from rlsys.system.model_source import snapshot_of

    try:
        here = snapshot_of(snapshot.repo_id, snapshot.commit)
    except ConfigError as error:
        return f"{snapshot.repo_id} at {snapshot.commit[:12]} is not in this node's hub cache: {error}"
    if here != Path(snapshot.path):
        return (f"{snapshot.repo_id} resolves to {here} on this node, to {snapshot.path} on the driver; give every "
                "node the same hub cache path (HF_HOME or HF_HUB_CACHE, ideally on shared storage)")
    return None


def read_gpus() -> tuple[GpuInfo, ...]:
    """Every GPU of this node (NVML); () without a driver or without pynvml."""
    try:
        import pynvml
    except ImportError:
        return ()
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return ()  # no driver: no GPU on this node
    modes = {pynvml.NVML_COMPUTEMODE_DEFAULT: "default", pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS: "exclusive_process",
             pynvml.NVML_COMPUTEMODE_PROHIBITED: "prohibited"}
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        cuda = pynvml.nvmlSystemGetCudaDriverVersion()  # e.g. 13000
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            gpus.append(GpuInfo(index, _text(pynvml.nvmlDeviceGetName(handle)),
                                int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                                modes.get(pynvml.nvmlDeviceGetComputeMode(handle), "unknown"), driver,
                                f"{cuda // 1000}.{cuda % 1000 // 10}"))
        return tuple(gpus)
    except pynvml.NVMLError:
        return ()
    finally:
        pynvml.nvmlShutdown()


def smallest_gpu_bytes() -> int | None:
    """The memory of this node's smallest GPU (NVML); None without GPUs."""
    return min((gpu.memory_bytes for gpu in read_gpus()), default=None)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass
class PlacementNodes:
    """The nodes a placement landed on, and what each holds."""

    roles: dict[str, list[str]] = field(default_factory=dict)  # node id -> roles

    def add(self, node_id: str, role: str) -> None:
        self.roles.setdefault(node_id, []).append(role)


def probe_nodes(nodes: PlacementNodes, run_dir: Path | None, model_paths: tuple[str, ...],
                hub: tuple[HubSnapshot, ...] = ()) -> list[NodeReport]:
    """Every node's report (module docstring); the driver's run-dir marker is removed after. No
    run_dir: that check is not made (`rlsys doctor` without a config)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    token = secrets.token_hex(16)
    marker = f"{MARKER_PREFIX}{token[:8]}"
    if run_dir is not None:
        (run_dir / marker).write_text(token)
    try:
        here = ray.get_runtime_context().get_node_id()
        remote_probe = ray.remote(num_cpus=0, max_retries=0)(probe_this_node)
        pending = {
            node_id: remote_probe.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(
                run_dir and str(run_dir), marker, token, model_paths, node_id, tuple(roles), hub)
            for node_id, roles in nodes.roles.items() if node_id != here
        }
        shared = run_dir and str(run_dir)
        reports = [probe_this_node(shared, marker, token, model_paths, here, tuple(nodes.roles[here]), hub)] \
            if here in nodes.roles else []
        reports += [ray.get(call) for call in pending.values()]
    finally:
        if run_dir is not None:
            (run_dir / marker).unlink(missing_ok=True)
    return reports


def refuse_unusable_nodes(reports: list[NodeReport], run_dir: Path, model_paths: tuple[str, ...]) -> None:
    """NodeCheckFailed naming every node that cannot see the run directory or the model."""
    blind = [r for r in reports if r.run_dir_problem]
    if blind:
        lines = [f"  {r.describe()}: {r.run_dir_problem}" for r in blind]
        hint = (" (a relative run_dir resolves inside each node's own copy of the job's working directory)"
                if "runtime_resources" in str(run_dir) else "")
        raise NodeCheckFailed(
            f"run_dir {run_dir} is not on storage that every node of the run sees{hint}:\n" + "\n".join(lines)
            + "\nTrainer ranks write checkpoint shards and engines write logs there from their own nodes. Set run_dir "
            "to a directory on a filesystem every node mounts at the same path (NFS, a shared volume), e.g. "
            "run_dir=/mnt/shared/runs/NAME"
        )
    missing = [r for r in reports if r.model_problem]
    if missing:
        lines = [f"  {r.describe()}: {r.model_problem}" for r in missing]
        raise NodeCheckFailed(
            f"the model ({', '.join(model_paths)}) is not on every node that loads it:\n" + "\n".join(lines)
            + "\nPut it on storage every node mounts at the same path (or copy it to that path on each node) "
            "and set model.path to it"
        )


def device_memory_budget(reports: list[NodeReport], has_gpu: bool) -> tuple[int, str]:
    """(bytes of one device, where the figure comes from) over the nodes: the smallest GPU when the
    run uses GPUs, else the smallest node's RAM (a CPU run's "device" is host memory)."""
    if has_gpu:
        gpus = [r for r in reports if r.gpu_memory_bytes]
        if gpus:
            smallest = min(gpus, key=lambda r: r.gpu_memory_bytes)
            return smallest.gpu_memory_bytes, f"the smallest GPU of the run's nodes ({smallest.describe()}, NVML)"
        raise NodeCheckFailed("the run uses GPUs but NVML reports none on its nodes "
                              f"({', '.join(r.describe() for r in reports)}); set placement.gpu_memory_gb")
    smallest = min(reports, key=lambda r: r.host_memory_bytes)
    return smallest.host_memory_bytes, f"the RAM of {smallest.describe()}"
