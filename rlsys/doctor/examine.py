"""`rlsys doctor [CONFIG]`: before a job, what each node the run would use offers and whether the
run can work there; every problem named with its node and what to change.

With a config it reserves the run's own placement (rlsys/actors/placement.py, so it checks the
nodes the run would land on, and a run that cannot be placed is the first blocker), probes every
node with the checks `rlsys train` runs at start (rlsys/run/placement_checks.py `probe_placement_nodes`,
`judge_placement_nodes`: one implementation, two callers), then puts one agent in a bundle of
each node (rlsys/system/net_checks.py) for ports, clocks and a collective test over the run's
backend. Without a config: every alive node of the cluster, without the run's own checks.
Everything it reserves, starts or writes is gone when it returns.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from rlsys.config import ConfigError, RunConfig
from rlsys.system.net_checks import CollectiveResult, NodeAgent, all_reduce_bus_bandwidth, connect_problem
from rlsys.system.node_checks import NodeReport, PlacementNodes, package_versions, probe_nodes

logger = logging.getLogger(__name__)

MiB = 2**20
# /dev/shm a node needs beyond a run's staging buffers: SGLang's and multiprocessing's segments on
# every node; on GPU nodes NCCL's intra-node transport (Docker's default 64 MiB fails it: "NCCL WARN
# Error: failed to extend /dev/shm").
SHM_FLOOR_BYTES = {False: 64 * MiB, True: 1024 * MiB}
CLOCK_SKEW_WARNING_S = 1.0
PORT_TIMEOUT_S = 3.0
# The collective test's tensor and repeats: enough to measure a link, little next to a run's start.
COLLECTIVE_BYTES = {False: 16 * MiB, True: 256 * MiB}
COLLECTIVE_REPEATS = {False: 3, True: 5}
# Packages that must be the same version on every node and the driver (flash-attn: a warning).
MUST_AGREE = ("python", "torch", "sglang", "transformers", "ray")


@dataclass(frozen=True)
class Problem:
    severity: Literal["blocker", "warning"]
    where: str  # "node 10.0.0.12 (host; engine-0)", "driver", "cluster"
    what: str
    fix: str


@dataclass
class NodeRow:
    report: NodeReport
    shm_needed_bytes: int
    clock_skew_s: float | None = None  # node clock - driver clock, midpoint of the round trip
    unreachable: list[str] = field(default_factory=list)  # "from <node>: <why>"


@dataclass
class Collectives:
    backend: str
    nodes: list[str]  # the agents' node addresses, by rank
    nbytes: int = 0
    all_reduce_bus_gbps: float | None = None
    broadcast_gbps: dict[str, float] = field(default_factory=dict)  # "a -> b" -> GB/s
    bound_gbps: float | None = None
    bound: str = ""
    full_sync_s: float | None = None  # the run's whole weight sync at the slowest pair's bandwidth
    skipped: str | None = None


@dataclass
class DoctorReport:
    nodes: list[NodeRow]
    collectives: Collectives | None
    problems: list[Problem]
    env: dict[str, str]
    driver_versions: dict[str, str | None]
    has_gpu: bool

    @property
    def blockers(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "blocker"]

    def as_json(self) -> dict:
        return {"ok": not self.blockers, **asdict(self)}


def examine(config: RunConfig | None, address: str | None) -> DoctorReport:
    """The whole check (module docstring). Joins the cluster at `address` (or the config's
    placement.ray_address / RAY_ADDRESS), else starts a local one as `rlsys train` would."""
    from rlsys.errors import RunFailed
    from rlsys.system.cluster import ray_cluster
    from rlsys.system.topology import Topology

    problems: list[Problem] = []
    layout = Topology.from_config(config, has_gpu=False) if config is not None else None
    with ExitStack() as stack:
        try:
            stack.enter_context(ray_cluster(address or (config.placement.ray_address if config else None),
                                            (config.placement.num_cpus or layout.local_cpus()) if layout else 2,
                                            layout.custom_resources() if layout else None))
        except RunFailed as error:  # no cluster at the address: the report says so (--json: still one document)
            problems.append(Problem("blocker", "cluster", str(error),
                                    "start the cluster, or give the address of one that runs (--address)"))
            return DoctorReport([], None, problems, {}, package_versions(), False)
        if config is None:
            rows, agents, has_gpu, env = _whole_cluster(stack, problems)
        else:
            rows, agents, has_gpu, env = _run_nodes(config, layout, stack, problems)
        driver_versions = package_versions()
        if rows:
            problems += version_problems(rows, driver_versions)
            problems += shm_problems(rows)
            problems += gpu_problems(rows, has_gpu, config)
        collectives = None
        if agents:
            _measure_clocks(rows, agents)
            problems += clock_problems(rows)
            ports_ok = _check_ports(rows, agents, problems)
            collectives = _collectives(config, agents, has_gpu, ports_ok, problems)
    if config is not None:
        problems += status_port_problems(config)
    return DoctorReport(rows, collectives, problems, env, driver_versions, has_gpu)


# ---- which nodes ---------------------------------------------------------------------------


def _run_nodes(config: RunConfig, layout, stack: ExitStack, problems: list[Problem]):
    """The run's placement, its nodes' reports and one agent per node (two on a one-node run)."""
    from rlsys.actors.placement import create_placement
    from rlsys.errors import RunFailed, why_not_a_directory
    from rlsys.run.absolute_paths import default_run_dir
    from rlsys.run.components import trainer_env
    from rlsys.run.placement_checks import judge_placement_nodes, probe_placement_nodes, run_uses_gpus
    from rlsys.system.topology import Topology

    env = trainer_env(config)
    try:
        topology = Topology.from_config(config, run_uses_gpus(config, layout))
    except RunFailed as error:
        problems.append(Problem("blocker", "cluster", str(error), "placement.device, or the cluster's GPUs"))
        return [], [], False, env
    try:
        placement = create_placement(topology, timeout_s=60.0)
    except TimeoutError as error:
        problems.append(Problem("blocker", "cluster", f"the run cannot be placed: {error}",
                                "add nodes or resources, or ask for fewer (trainer.num_ranks, rollout.num_engines, "
                                "placement.*_node_resources)"))
        return [], [], topology.has_gpu, env
    stack.callback(placement.remove)
    # What `rlsys train` would write to: run_dir, or its default under this directory.
    run_dir = Path(config.run_dir or default_run_dir()).absolute()
    try:
        with _scratch_directory(run_dir):
            reports = probe_placement_nodes(config, topology, placement, run_dir)
    except OSError as error:  # `rlsys train` refuses the same run_dir (rlsys/system/run_lock.py)
        problems.append(Problem("blocker", "driver", f"run_dir {run_dir} cannot be used: "
                                f"{why_not_a_directory(run_dir, error)}", "choose another run_dir"))
        run_dir = None
        reports = probe_placement_nodes(config, topology, placement, None)
    try:
        judge_placement_nodes(config, topology, reports, run_dir)
    except ConfigError as error:  # the same refusal `rlsys train` makes at start; its last line says what to set
        *what, fix = str(error).strip().splitlines() or [""]
        problems.append(Problem("blocker", "nodes", "\n".join(what) or fix, fix if what else "see above"))
    rows = [NodeRow(report, shm_needed(config, topology, report.roles)) for report in reports]
    bundles = topology.bundles()
    bundle_nodes = placement.bundle_nodes()
    first_bundle = {}
    for index, node_id in enumerate(bundle_nodes):
        first_bundle.setdefault(node_id, []).append(index)
    slots = [indices[0] for indices in first_bundle.values()]
    if len(slots) == 1 and len(bundle_nodes) > 1:
        slots.append(first_bundle[bundle_nodes[0]][1])  # one node: a collective between two of its bundles
    elif len(slots) == 1 and not topology.has_gpu:
        slots.append(slots[0])  # one bundle on CPUs: two processes in it
    agents = [_agent(env, topology.has_gpu, bundles[slot].get("GPU", 0),
                     placement_group=placement.group, bundle=slot) for slot in slots]
    stack.callback(_stop_agents, agents)
    return rows, agents, topology.has_gpu, env


def _whole_cluster(stack: ExitStack, problems: list[Problem]):
    """Every alive node (no config): reports without the run's own checks, an agent on each."""
    import ray

    from rlsys.system.cluster import ACTOR_ENV

    alive = [node for node in ray.nodes() if node["Alive"]]
    has_gpu = bool(alive) and all(node["Resources"].get("GPU", 0) >= 1 for node in alive)
    placed = PlacementNodes()
    for node in alive:
        placed.add(node["NodeID"], "node")
    reports = probe_nodes(placed, None, ())
    rows = [NodeRow(report, SHM_FLOOR_BYTES[bool(report.gpus)]) for report in reports]
    node_ids = [node["NodeID"] for node in alive]
    if len(node_ids) == 1 and not has_gpu:
        node_ids.append(node_ids[0])
    agents = [_agent(dict(ACTOR_ENV), has_gpu, 1 if has_gpu else 0, node_id=node_id) for node_id in node_ids]
    stack.callback(_stop_agents, agents)
    return rows, agents, has_gpu, dict(ACTOR_ENV)


def _agent(env: dict[str, str], has_gpu: bool, gpus: float, placement_group=None, bundle: int = 0,
           node_id: str | None = None):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

    strategy = (PlacementGroupSchedulingStrategy(placement_group=placement_group, placement_group_bundle_index=bundle)
                if placement_group is not None else NodeAffinitySchedulingStrategy(node_id, soft=False))
    return ray.remote(NodeAgent).options(num_cpus=0, num_gpus=gpus, scheduling_strategy=strategy,
                                         runtime_env={"env_vars": env}, max_restarts=0).remote(has_gpu)


def _stop_agents(agents) -> None:
    import ray

    for agent in agents:
        ray.kill(agent)


@contextmanager
def _scratch_directory(run_dir: Path):
    """run_dir, made for the check when missing and removed after (only what this made, if empty)."""
    made = [parent for parent in [run_dir, *run_dir.parents] if not parent.exists()]
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        yield run_dir
    finally:
        for directory in made:  # deepest first
            try:
                directory.rmdir()
            except OSError:
                break


# ---- judgements over the reports (pure) ------------------------------------------------------


def shm_needed(config: RunConfig, topology, roles: tuple[str, ...]) -> int:
    """/dev/shm a node must have free for the run: on CPUs the colocated weight sync stages its
    buckets there (two staging buffers of a bucket each, weight_sync/colocated.py StagingSlots) on
    a node that holds an engine; plus SHM_FLOOR_BYTES."""
    floor = SHM_FLOOR_BYTES[topology.has_gpu]
    holds_engine = any(role.startswith("engine") for role in roles)
    if topology.mode == "colocated" and not topology.has_gpu and holds_engine:
        return floor + 2 * int(config.weight_sync.bucket_size_mb * MiB)
    return floor


def version_problems(rows: list[NodeRow], driver: dict[str, str | None]) -> list[Problem]:
    """A package at another version on some nodes (than on most nodes and the driver), or missing
    where the run imports it: torch everywhere, sglang where an engine runs."""
    problems = []
    for package in (*MUST_AGREE, "flash_attn"):
        seen = Counter(v for v in [driver.get(package), *(row.report.versions.get(package) for row in rows)] if v)
        if len(seen) > 1:
            # the most common version; on a tie the driver's
            usual = max(seen, key=lambda v: (seen[v], v == driver.get(package)))
            odd = [row for row in rows if row.report.versions.get(package) not in (None, usual)]
            for row in odd:
                problems.append(Problem(
                    "warning" if package == "flash_attn" else "blocker", row.report.describe(),
                    f"{package} {row.report.versions[package]} here, {usual} on "
                    f"{'the driver and ' if driver.get(package) == usual else ''}the other nodes",
                    f"install {package}=={usual} on this node (pip install '{package.replace('_', '-')}=={usual}'), "
                    "or run every node from the same image"))
            if driver.get(package) not in (None, usual):
                problems.append(Problem("blocker", "driver", f"{package} {driver[package]} on the driver, {usual} on "
                                        "the nodes", f"install {package}=={usual} where the driver runs"))
    for row in rows:
        if row.report.versions.get("torch") is None:
            problems.append(Problem("blocker", row.report.describe(), "torch is not installed",
                                    "install rlsys's environment on this node (make install, or the image)"))
        if any(role.startswith("engine") for role in row.report.roles) and row.report.versions.get("sglang") is None:
            problems.append(Problem("blocker", row.report.describe(), "sglang is not installed on a node that runs an "
                                    "engine", "install sglang==0.5.23 on this node (make install, or the image)"))
    return problems


def shm_problems(rows: list[NodeRow]) -> list[Problem]:
    return [Problem("blocker", row.report.describe(),
                    f"/dev/shm has {_size(row.report.shm_free_bytes)} free of {_size(row.report.shm_total_bytes)}; the "
                    f"run needs {_size(row.shm_needed_bytes)} there",
                    "give the node a larger /dev/shm (docker run --shm-size=16g; Kubernetes: an emptyDir with medium: "
                    "Memory mounted at /dev/shm), or free what stale files hold")
            for row in rows if row.report.shm_free_bytes < row.shm_needed_bytes]


def gpu_problems(rows: list[NodeRow], has_gpu: bool, config: RunConfig | None) -> list[Problem]:
    if not has_gpu:
        return []
    problems = []
    shared = config is not None and config.placement.mode == "colocated"
    for row in rows:
        for gpu in row.report.gpus:
            if gpu.compute_mode == "prohibited" or (shared and gpu.compute_mode == "exclusive_process"):
                problems.append(Problem(
                    "blocker", row.report.describe(), f"GPU {gpu.index} ({gpu.name}) is in compute mode "
                    f"{gpu.compute_mode}{'; colocated trainer ranks and engines share each GPU' if shared else ''}",
                    f"nvidia-smi -i {gpu.index} -c DEFAULT (root), or ask the cluster's admin"))
    names = {gpu.name for row in rows for gpu in row.report.gpus}
    if len(names) > 1:
        problems.append(Problem("warning", "cluster", f"the nodes hold different GPUs ({', '.join(sorted(names))}): "
                                "the memory plan budgets for the smallest, and the slowest sets the step's pace",
                                "keep a run's nodes alike (placement.*_node_resources)"))
    return problems


def clock_problems(rows: list[NodeRow]) -> list[Problem]:
    return [Problem("warning", row.report.describe(), f"its clock is {row.clock_skew_s:+.2f} s off the driver's",
                    "run a time daemon (chrony, systemd-timesyncd) on every node; logs, traces and step times across "
                    "nodes stop lining up")
            for row in rows if row.clock_skew_s is not None and abs(row.clock_skew_s) > CLOCK_SKEW_WARNING_S]


def status_port_problems(config: RunConfig) -> list[Problem]:
    """The dashboard's fixed port must be free where the driver runs (this machine)."""
    import socket

    if not config.status.enabled or config.status.port == 0:
        return []
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((config.status.host, config.status.port))
        except OSError as error:
            return [Problem("blocker", "driver", f"status.port {config.status.port} on {config.status.host} cannot be "
                            f"bound here: {error.strerror or error}",
                            "status.port=0 (a free port) or another port; or stop what holds it")]
    return []


def broadcast_bound(config: RunConfig | None) -> tuple[float | None, str]:
    """(least bytes/s, why) a link between the run's nodes must carry: one weight-sync bucket within
    weight_sync.timeout_s, or the broadcast waiting on it times out."""
    if config is None:
        return None, ""
    bucket = config.weight_sync.bucket_size_mb * MiB
    return (bucket / config.weight_sync.timeout_s,
            f"one weight-sync bucket ({config.weight_sync.bucket_size_mb:g} MiB) within weight_sync.timeout_s "
            f"({config.weight_sync.timeout_s:g} s)")


# ---- measured with the agents ----------------------------------------------------------------


def _measure_clocks(rows: list[NodeRow], agents) -> None:
    import ray

    by_address = {row.report.address: row for row in rows}
    for agent in agents:
        _, address = ray.get(agent.node.remote())
        before = time.time()
        theirs = ray.get(agent.clock.remote())
        after = time.time()
        row = by_address.get(address)
        if row is not None and row.clock_skew_s is None:
            row.clock_skew_s = theirs - (before + after) / 2


def _check_ports(rows: list[NodeRow], agents, problems: list[Problem]) -> bool:
    """Each agent's listening port reached from every other agent's node and from the driver."""
    import ray

    from rlsys.system.node import node_address

    listening = ray.get([agent.open_port.remote() for agent in agents])
    try:
        by_address = {row.report.address: row for row in rows}
        addresses = [address for address, _ in listening]
        answers = ray.get([agent.reach.remote([t for t in listening if t[0] != mine], PORT_TIMEOUT_S)
                           for agent, mine in zip(agents, addresses, strict=True)])
        driver = node_address()
        answers.append({f"{host}:{port}": connect_problem(host, port, PORT_TIMEOUT_S) for host, port in listening})
        sources = [*addresses, f"the driver ({driver})"]
        ok = True
        for source, reached in zip(sources, answers, strict=True):
            for target, problem in reached.items():
                if problem is None:
                    continue
                ok = False
                host, port = target.rsplit(":", 1)
                row = by_address.get(host)
                if row is not None:
                    row.unreachable.append(f"from {source}: {problem}")
                problems.append(Problem(
                    "blocker", row.report.describe() if row else host,
                    f"port {port} (a free port, as the run's engines and collective groups open theirs) cannot be "
                    f"reached from {source}: {problem}",
                    "allow TCP between the cluster's nodes on the ephemeral range (on this node: cat "
                    "/proc/sys/net/ipv4/ip_local_port_range) in its firewall or security group"))
        return ok
    finally:
        ray.get([agent.close_port.remote() for agent in agents])


def _collectives(config: RunConfig | None, agents, has_gpu: bool, ports_ok: bool,
                 problems: list[Problem]) -> Collectives:
    import ray

    addresses = [ray.get(agent.node.remote())[1] for agent in agents]
    backend = "nccl" if has_gpu else "gloo"
    result = Collectives(backend, addresses)
    result.bound_gbps, result.bound = broadcast_bound(config)
    if result.bound_gbps is not None:
        result.bound_gbps /= 1e9
    if len(agents) < 2:
        result.skipped = "one GPU in the placement: no collective between devices to test"
        return result
    if not ports_ok:
        result.skipped = "not run: the nodes cannot reach each other's ports (above)"
        return result
    timeout_s = config.weight_sync.timeout_s if config is not None else 120.0
    nbytes, repeats = COLLECTIVE_BYTES[has_gpu], COLLECTIVE_REPEATS[has_gpu]
    port = ray.get(agents[0].free_port.remote())
    calls = [agent.collectives.remote(addresses[0], port, rank, len(agents), nbytes, repeats, timeout_s)
             for rank, agent in enumerate(agents)]
    ready, pending = ray.wait(calls, num_returns=len(calls), timeout=timeout_s + 30)
    if pending:
        stuck = [addresses[calls.index(call)] for call in pending]
        result.skipped = f"did not finish within {timeout_s + 30:g} s"
        problems.append(Problem("blocker", "cluster", f"the {backend} collective test between {', '.join(addresses)} "
                                f"did not finish within {timeout_s + 30:g} s; still waiting: {', '.join(stuck)}",
                                _collective_fix(backend)))
        return result
    try:
        measured: list[CollectiveResult] = ray.get(calls)
    except ray.exceptions.RayError as error:
        result.skipped = "failed"
        cause = str(getattr(error, "cause", None) or error).strip().splitlines()
        problems.append(Problem("blocker", "cluster", f"the {backend} collective test between {', '.join(addresses)} "
                                f"failed: {cause[-1] if cause else error}", _collective_fix(backend)))
        return result
    result.nbytes = nbytes
    result.all_reduce_bus_gbps = all_reduce_bus_bandwidth(nbytes, measured[0].all_reduce_s, len(agents)) / 1e9
    if not all(m.all_reduce_correct for m in measured):
        problems.append(Problem("blocker", "cluster", f"the {backend} all-reduce returned a wrong sum",
                                _collective_fix(backend)))
    for source in range(len(agents)):
        for target in range(source + 1, len(agents)):
            key = f"{source}-{target}"
            seconds = max(m.broadcast_s.get(key, 0.0) for m in measured)
            result.broadcast_gbps[f"{addresses[source]} -> {addresses[target]}"] = nbytes / seconds / 1e9
    slowest = min(result.broadcast_gbps.values(), default=None)
    if slowest is not None and result.bound_gbps is not None and slowest < result.bound_gbps:
        problems.append(Problem("blocker", "cluster", f"the slowest {backend} broadcast moved {slowest:.3g} GB/s, below "
                                f"{result.bound_gbps:.3g} GB/s: {result.bound}",
                                "raise weight_sync.timeout_s or lower weight_sync.bucket_size_mb, or fix the link "
                                "(NCCL_SOCKET_IFNAME / NCCL_IB_HCA in placement.env)"))
    weights = _weight_bytes(config, has_gpu) if slowest and config is not None else None  # builds the model on meta
    if weights:
        result.full_sync_s = weights / (slowest * 1e9)
    return result


def _collective_fix(backend: str) -> str:
    if backend == "nccl":
        return ("rerun with placement.env: {NCCL_DEBUG: INFO} and read which interface NCCL chose; set "
                "NCCL_SOCKET_IFNAME (and NCCL_IB_HCA) in placement.env")
    return "set GLOO_SOCKET_IFNAME in placement.env to the interface that joins the nodes"


def _weight_bytes(config: RunConfig, has_gpu: bool) -> int | None:
    """Bytes of one full weight sync: the model's parameters in the engine's dtype."""
    import torch

    from rlsys.model.shape import ModelShape
    from rlsys.system.backend import engine_dtype

    try:
        params = ModelShape.from_model_dir(config.model.path).params
    except Exception:  # noqa: BLE001 - an estimate only; the model check above names a missing model
        return None
    return params * getattr(torch, engine_dtype(has_gpu, config.model.dtype)).itemsize


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / MiB:.0f} MiB"


# ---- the report ----------------------------------------------------------------------------


def print_report(report: DoctorReport) -> None:
    from rich.console import Console
    from rich.table import Table

    # One column per node, one row per check: reads at a terminal's width for a few nodes.
    console = Console(width=max(Console().width, 40 + 32 * len(report.nodes)), soft_wrap=True)
    table = Table(title="rlsys doctor: the run's nodes")
    table.add_column("")
    for row in report.nodes:
        table.add_column(f"{row.report.address} ({row.report.hostname})")

    def gpus(r: NodeReport) -> str:
        listed = "\n".join(f"{g.index}: {g.name} {_size(g.memory_bytes)} {g.compute_mode}" for g in r.gpus)
        return f"{listed}\n(driver {r.gpus[0].driver}, CUDA {r.gpus[0].cuda})" if r.gpus else "none"

    checks = {
        "roles": lambda row: ", ".join(row.report.roles),
        "CPUs": lambda row: str(row.report.cpus),
        "RAM": lambda row: _size(row.report.host_memory_bytes),
        "/dev/shm free (needs)": lambda row: f"{_size(row.report.shm_free_bytes)} ({_size(row.shm_needed_bytes)})",
        "GPUs": lambda row: gpus(row.report),
        **{name: (lambda row, name=name: row.report.versions.get(name) or "-")
           for name in ("python", "torch", "sglang", "transformers", "ray", "flash_attn")},
        "run_dir": lambda row: row.report.run_dir_problem or "ok",
        "model": lambda row: row.report.model_problem or "ok",
        "ports": lambda row: "\n".join(row.unreachable) or "ok",
        "clock vs driver": lambda row: "-" if row.clock_skew_s is None else f"{row.clock_skew_s:+.3f} s",
    }
    for name, cell in checks.items():
        table.add_row(name, *(cell(row) for row in report.nodes))
    if report.nodes:  # none when no cluster was reached: the blocker below says why
        console.print(table)
    c = report.collectives
    if c is not None:
        if c.skipped:
            console.print(f"collective test ({c.backend}): {c.skipped}")
        else:
            console.print(f"collective test ({c.backend}, {_size(c.nbytes)} over {len(c.nodes)} processes on "
                          f"{', '.join(c.nodes)}): all-reduce {c.all_reduce_bus_gbps:.3g} GB/s bus bandwidth")
            for pair, gbps in c.broadcast_gbps.items():
                console.print(f"  broadcast {pair}: {gbps:.3g} GB/s")
            if c.bound_gbps is not None:
                console.print(f"  bound: {c.bound_gbps:.3g} GB/s ({c.bound})")
            if c.full_sync_s is not None:
                console.print(f"  the run's whole weight sync at the slowest pair's rate: ~{c.full_sync_s:.3g} s")
    if report.nodes:
        console.print("placement.env (trainer ranks and engines): "
                      + (" ".join(f"{k}={v}" for k, v in sorted(report.env.items())) or "none"))
    for problem in report.problems:
        console.print(f"[{'red' if problem.severity == 'blocker' else 'yellow'}]{problem.severity}[/]: "
                      f"{problem.where}: {problem.what}\n    fix: {problem.fix}", highlight=False)
    blockers = len(report.blockers)
    warnings = len(report.problems) - blockers
    console.print(f"rlsys doctor: {blockers} blocker(s), {warnings} warning(s)" if report.problems
                  else "rlsys doctor: every check passed")
