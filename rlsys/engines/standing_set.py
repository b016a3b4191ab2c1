"""`rlsys engines up|status|down`: a standing set started as a run would start its own engines
(the same placement, node checks and server spec: rlsys/run/engine_spec.py), listed, and stopped
with the trainer ranks it keeps."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import ray

from rlsys.actors.placement import Placement
from rlsys.config import RunConfig
from rlsys.rollout.standing import (
    SERVICE_NAMESPACE,
    EngineIdentity,
    EngineService,
    StandingEnginesError,
    StandingRecord,
    engine_handle,
    launch_engine,
    service,
    standing_names,
)
from rlsys.run.absolute_paths import with_absolute_paths
from rlsys.run.engine_spec import server_spec
from rlsys.run.placement_checks import check_placement_nodes, run_uses_gpus
from rlsys.system.cluster import ACTOR_ENV, cluster_address, ray_auth_notice_quiet
from rlsys.system.topology import Topology

logger = logging.getLogger(__name__)

# Logical CPUs of the Ray cluster `rlsys engines up` starts on this machine when none runs: slots
# for standing sets and the runs that attach to them (each takes CPUS_PER_ACTOR per actor), not cores.
LOCAL_HEAD_CPUS = 64
PLACEMENT_TIMEOUT_S = 120.0


@contextmanager
def connected(address: str):
    """ray.init joined to `address` for the block (nothing is started); a clear error if none runs."""
    if ray.is_initialized():  # a caller (a test) already holds a connection: use it, leave it
        yield
        return
    try:
        with ray_auth_notice_quiet():
            ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    except ConnectionError as error:
        raise StandingEnginesError(
            f"no Ray cluster at {address!r}"
            + (" on this machine" if address == "auto" else "")
            + f" ({str(error).splitlines()[0]}): start engines with `rlsys engines up CONFIG`, or give the "
            "cluster's address (placement.ray_address, --address or RAY_ADDRESS)") from None
    try:
        yield
    finally:
        ray.shutdown()


def start_local_head(topology: Topology) -> None:
    """`ray start --head` on this machine: a cluster that outlives this command (and the runs that
    join it), offering the custom resources the set's placement asks for."""
    import json

    ray_command = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray")
    if ray_command is None:
        raise StandingEnginesError("the `ray` command is not installed beside this Python")
    resources = {name: amount * 16 for name, amount in topology.custom_resources().items()}
    command = [ray_command, "start", "--head", f"--num-cpus={LOCAL_HEAD_CPUS}", "--include-dashboard=false",
               "--disable-usage-stats"] + ([f"--resources={json.dumps(resources)}"] if resources else [])
    env = {**os.environ, **ACTOR_ENV}  # the actors' one BLAS thread each, as a run's own local cluster gives
    logger.info("starting a Ray cluster on this machine (`ray start --head`; `rlsys engines down` stops it)")
    started = subprocess.run(command, env=env, capture_output=True, text=True, start_new_session=True)
    if started.returncode != 0:
        raise StandingEnginesError(f"`ray start --head` failed ({started.returncode}):\n{started.stderr[-2000:]}")


def stop_local_head() -> None:
    ray_command = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray")
    subprocess.run([ray_command, "stop"], capture_output=True, text=True)


def _layout(config: RunConfig) -> Topology:
    """The run's topology on the connected cluster (GPUs if it has the ones the placement needs)."""
    return Topology.from_config(config, run_uses_gpus(config, Topology.from_config(config, has_gpu=False)))


# ---- up / status / down -------------------------------------------------------------------

def engines_up(config: RunConfig, name: str, log_dir: Path, address: str | None = None,
               warm_trainers: bool = True) -> StandingRecord:
    """Start `config`'s engines as standing set `name` and return once every engine answers.
    `warm_trainers`: the set keeps the trainer ranks of the runs that attach (actors/warm_ranks.py)."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from rlsys.system.model_source import resolve_model_paths

    # Absolute paths: the engines' actors resolve none against a working directory.
    config = with_absolute_paths(resolve_model_paths(config), str(log_dir))
    address = cluster_address(config, address)
    started_here = False
    if address == "auto" and not _local_cluster_running():
        start_local_head(Topology.from_config(config, has_gpu=False))
        started_here = True
    log_dir = log_dir.absolute()
    with connected(address):
        if name in standing_names():
            raise StandingEnginesError(f"standing engines {name!r} are already running (`rlsys engines status`); "
                                       f"stop them first (`rlsys engines down --name {name}`) or choose another --name")
        start = time.perf_counter()
        topology = _layout(config)
        group = placement_group(topology.bundles(), strategy="PACK", lifetime="detached")
        ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            remove_placement_group(group)
            raise StandingEnginesError(f"Ray could not place the engines' {len(topology.bundles())} bundles within "
                                       f"{PLACEMENT_TIMEOUT_S:.0f} s; cluster resources: {ray.cluster_resources()}")
        placement = Placement(group, topology)
        try:
            log_dir.mkdir(parents=True, exist_ok=True)
            check_placement_nodes(config, topology, placement, log_dir)
            spec = server_spec(config, topology, topology.cpu_sharers(placement.bundle_nodes())[1])
            record = StandingRecord(
                name=name, identity=EngineIdentity.of(spec, topology), spec=spec, topology=topology,
                placement_group=group, log_dir=str(log_dir), model_path=config.model.path, started_at=time.time(),
                started_by=f"{socket.gethostname()} pid {os.getpid()}",
                engine_options=tuple(placement.engine_options()), ray_started_here=started_here,
                warm_trainers=warm_trainers)
            # The record first: a set that fails to come up is still found, and stopped, by name.
            keeper = ray.remote(EngineService).options(name=name, namespace=SERVICE_NAMESPACE, lifetime="detached",
                                                       num_cpus=0).remote(record)
            ray.get(keeper.record.remote())
            engines = [launch_engine(record, index) for index in range(topology.num_engines)]
            ray.get([engine.start.remote(spec.startup_timeout_s) for engine in engines])
            # An engine's first weight update costs ~2 s more than the next ones (its actor imports
            # torch to send it): paid here, where nobody waits, not by the first run that attaches.
            ray.get([engine.restart_random_stream.remote(config.seed) for engine in engines])
        except BaseException:
            _stop_set(name, group)
            raise
        logger.info("%d standing engine(s) %r up in %.1f s (logs in %s)", topology.num_engines, name,
                    time.perf_counter() - start, log_dir)
        return record


def _local_cluster_running() -> bool:
    """Whether `ray start` left a cluster on this machine that answers."""
    try:
        with connected("auto"):
            return True
    except StandingEnginesError:
        return False


def engines_status(address: str | None = None) -> list[dict]:
    """Every standing set of the cluster: its record, lease and each engine's state."""
    reports = []
    with connected(cluster_address(address=address)):
        for name in standing_names():
            keeper = service(name)
            record: StandingRecord = ray.get(keeper.record.remote())
            lease = ray.get(keeper.lease.remote())
            engines = []
            for index in range(record.topology.num_engines):
                try:
                    engine = engine_handle(record, index)
                    health = ray.get(engine.health.remote(), timeout=10)
                    version = ray.get(engine.weight_version.remote(), timeout=10) if health["alive"] else None
                    engines.append({"index": index, **health, "weight_version": version})
                except Exception as error:  # noqa: BLE001 - a dead engine is reported, restarted at the next attach
                    engines.append({"index": index, "alive": False, "url": "", "memory_bytes": None,
                                    "weight_version": None, "error": str(error).splitlines()[0][:200]})
            reports.append({"name": name, "model": record.model_path, "mode": record.topology.mode,
                            "num_ranks": record.topology.num_ranks, "tp_size": record.spec.engine.tp_size,
                            "dtype": record.spec.dtype, "gpus": record.topology.has_gpu, "log_dir": record.log_dir,
                            "started_at": record.started_at, "started_by": record.started_by,
                            "lease": lease, "engines": engines})
    return reports


def status_table(reports: list[dict]) -> str:
    """`rlsys engines status` as text: one block per set, one line per engine."""
    if not reports:
        return "no standing engines in this Ray cluster"
    blocks = []
    for report in reports:
        lease = report["lease"]
        lines = [f"{report['name']}: {report['model']} ({report['mode']}, {report['num_ranks']} trainer slot(s), "
                 f"tp {report['tp_size']}, {report['dtype']}, {'GPUs' if report['gpus'] else 'CPUs'}); "
                 + (f"in use by {lease['description']} for {lease['held_s']:.0f} s" if lease else "free")
                 + f"; logs {report['log_dir']}"]
        for engine in report["engines"]:
            memory = engine.get("memory_bytes")
            lines.append(f"  engine-{engine['index']}: {'up' if engine['alive'] else 'DOWN'} {engine.get('url', '')}"
                         + (f" weight version {engine['weight_version']}" if engine.get("weight_version") is not None
                            else "")
                         + (f", {memory / 2**30:.2f} GiB host" if memory else "")
                         + (f" ({engine['error']})" if engine.get("error") else ""))
        blocks.append("\n".join(lines))
    return "\n".join(blocks)


def engines_down(name: str | None, force: bool = False, address: str | None = None) -> list[str]:
    """Stop standing set `name` (every set when None): each engine's server and its /dev/shm files,
    the placement group and the record; and the Ray cluster `engines up` started on this machine,
    once no set is left in it. A set leased to a run is refused unless `force`. The names stopped."""
    stop_head = False
    forced: list[dict] = []  # the leases of runs attached to a set stopped under them
    with connected(cluster_address(address=address)):
        names = standing_names() if name is None else [name]
        if name is not None:
            service(name)  # a clear error for an unknown name
        for each in names:
            keeper = service(each)
            lease = ray.get(keeper.lease.remote())
            if lease is not None and not force:
                raise StandingEnginesError(f"standing engines {each!r} are in use by {lease['description']}; stop "
                                           "that run first, or pass --force")
            if lease is not None:
                forced.append(lease)
            record: StandingRecord = ray.get(keeper.record.remote())
            _stop_set(each, record.placement_group, ranks_in_use=lease is not None)
            stop_head = stop_head or record.ray_started_here
            logger.info("standing engines %r stopped%s", each,
                        f" under {lease['description']}, which now fails at its next engine call" if lease else "")
        stop_head = stop_head and not standing_names()
    if stop_head and not _runs_ended(forced):
        logger.warning("left the Ray cluster `rlsys engines up` started on this machine up: a run attached to the "
                       "stopped engines is still connected to it (`rlsys engines down` again, or `ray stop`, once it "
                       "has ended)")
    elif stop_head:
        stop_local_head()
        logger.info("stopped the Ray cluster `rlsys engines up` started on this machine")
    return names


# How long `engines down --force` waits for a run it stopped the engines of to end before it stops
# the Ray cluster under it (such a run fails at its next engine call: within seconds).
FORCED_RUN_EXIT_S = 60.0


def _runs_ended(leases: list[dict]) -> bool:
    """Whether the runs holding `leases` have ended (waiting up to FORCED_RUN_EXIT_S for those on
    this machine); a run on another machine cannot be watched and counts as not ended."""
    import psutil

    deadline = time.monotonic() + FORCED_RUN_EXIT_S
    for lease in leases:
        holder = lease["holder"]
        if holder["host"] != socket.gethostname():
            return False
        while psutil.pid_exists(holder["pid"]):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.5)
    return True


def _stop_set(name: str, group, ranks_in_use: bool = False) -> None:
    """The trainer ranks the set keeps, the record (a run attached to the set then sees it gone, once
    its engine dies, and does not restart it), then the engines (their servers stopped by themselves:
    processes and /dev/shm files), then the placement group. Ranks a run holds (`ranks_in_use`) are
    left to it: when it fails it stops them, keeping none for a set that is gone."""
    from ray.util.placement_group import remove_placement_group

    from rlsys.actors.warm_ranks import stop_warm_ranks
    from rlsys.rollout.fleet import EngineFleet

    if not ranks_in_use:
        stop_warm_ranks(name)
    try:
        keeper = service(name)
        record: StandingRecord = ray.get(keeper.record.remote())
        count = record.topology.num_engines
        ray.kill(keeper)
    except StandingEnginesError:
        record, count = None, 0
    for index in range(count):
        try:
            engine = engine_handle(record, index)
        except ValueError:
            continue  # dead, or never launched
        EngineFleet.stop_engine(engine)
    remove_placement_group(group)
