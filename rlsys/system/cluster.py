"""Connect to the Ray cluster a job was submitted to, or start a local one."""

from __future__ import annotations

import logging
import os
import socket
from contextlib import contextmanager
from typing import TYPE_CHECKING

import psutil
import ray

from rlsys.errors import RunFailed
from rlsys.system.interrupts import children_in_process_groups_of_their_own
from rlsys.system.reaper import kill_and_wait

if TYPE_CHECKING:
    from rlsys.config import RunConfig

logger = logging.getLogger(__name__)

# Every actor process: one BLAS thread each (the machine's cores are shared by all ranks).
ACTOR_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@contextmanager
def ray_cluster(address: str | None, local_num_cpus: int, local_resources: dict[str, float] | None = None):
    """`ray.init` for the run; shuts down only what this process started or joined. A local cluster
    offers `local_resources` too (the custom resources the placement asks for)."""
    address = address or os.environ.get("RAY_ADDRESS")
    kwargs = dict(log_to_driver=False, logging_level=logging.WARNING)
    if address:
        logger.debug("joining the Ray cluster at %s", address)
        if (reason := unreachable(address)) is not None:  # ray.init would retry for minutes, warning every 5 s
            raise RunFailed(f"no Ray cluster at {address!r}: {reason} (placement.ray_address, RAY_ADDRESS; with "
                            "rollout.attach and neither set, the cluster `rlsys engines up` started on this machine)")
        # Under `ray job submit` the job's runtime env (working_dir, env vars) applies as given;
        # per-actor env vars are set where the actors are created.
        try:
            with ray_auth_notice_quiet():
                ray.init(address=address, **kwargs)
        except ConnectionError as error:
            raise RunFailed(f"no Ray cluster to join at {address!r}: {str(error).splitlines()[0]} (placement.ray_address, "
                            "RAY_ADDRESS; with rollout.attach and neither set, the cluster `rlsys engines up` started "
                            "on this machine)") from None
    else:
        # A local cluster keeps Ray's default token authentication; its start-up warning that token
        # auth is on (RAY_AUTH_MODE unset) asks nothing of a user of this one-process cluster.
        logger.debug("starting a local Ray cluster: %d CPUs, resources %s", local_num_cpus, local_resources or {})
        before = _children()
        with ray_auth_notice_quiet(), children_in_process_groups_of_their_own():
            # address "local": a cluster of its own even beside one `ray start` (`rlsys engines up`) left
            # on this machine, which ray.init would otherwise join (and refuse num_cpus for).
            ray.init(address="local", num_cpus=local_num_cpus, resources=local_resources or None,
                     include_dashboard=False, runtime_env={"env_vars": ACTOR_ENV}, **kwargs)
        local_cluster = [p for pid, p in _children().items() if pid not in before]
    try:
        yield
    finally:
        # Noted before the shutdown: once the raylet is gone its workers (the actors) are init's.
        workers = [] if address else _with_descendants(local_cluster)
        ray.shutdown()
        _wait_for_exit(workers)


# A Ray head answers a TCP connection on its GCS port at once; a few seconds cover a slow network.
CONNECT_TIMEOUT_S = 5.0


def unreachable(address: str) -> str | None:
    """Why nothing accepts a connection at a HOST:PORT Ray address within CONNECT_TIMEOUT_S (the
    reason, e.g. "Connection refused"), or None: it does, or the address is not of that form
    ("auto", "local", a ray:// client address: Ray resolves those itself)."""
    host, _, port = address.rpartition(":")
    if address in ("auto", "local") or "://" in address or not host or not port.isdigit():
        return None
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S):
            return None
    except OSError as error:
        return error.strerror or str(error) or type(error).__name__


# How long the actors' worker processes get to exit on their own after ray.shutdown: a killed actor
# or an orphaned worker notices its raylet is gone within a second or two, slower on a loaded machine.
WORKER_EXIT_GRACE_S = 20.0


def _children() -> dict[int, psutil.Process]:
    return {p.pid: p for p in psutil.Process().children()}


def _with_descendants(processes: list[psutil.Process]) -> list[psutil.Process]:
    found = []
    for process in processes:
        try:
            found += [process, *process.children(recursive=True)]
        except psutil.Error:
            continue
    return found


def _wait_for_exit(processes: list[psutil.Process]) -> None:
    """ray.shutdown stops the local cluster's GCS and raylet, and its ray.kill of each actor is only
    a request: the actors' worker processes exit after it returns. Wait for them, so that nothing of
    the run outlives the driver, and stop any that do not exit (psutil checks each pid is still the
    process noted, not a recycled one)."""
    _, alive = psutil.wait_procs(processes, timeout=WORKER_EXIT_GRACE_S)
    if alive:
        logger.warning("%d process(es) of the local Ray cluster did not exit within %.0f s of its shutdown: "
                       "killed (%s)", len(alive), WORKER_EXIT_GRACE_S, ", ".join(str(p.pid) for p in alive))
    kill_and_wait(alive, 5.0)


_RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


@contextmanager
def ray_auth_notice_quiet():
    """ray.init without its WARNING that token authentication is on (RAY_AUTH_MODE unset): a notice
    about Ray's defaults, printed on every connection, that asks nothing of an rlsys user. Refusals
    (a wrong or missing token) are errors and still show."""
    logger = logging.getLogger(_RAY_AUTH_LOGGER)
    previous = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(previous)


def cluster_address(config: RunConfig | None = None, address: str | None = None) -> str:
    """Where standing engines live: --address, placement.ray_address, RAY_ADDRESS, or "auto" (the
    cluster `ray start` / `rlsys engines up` started on this machine)."""
    return (address or (config.placement.ray_address if config is not None else None)
            or os.environ.get("RAY_ADDRESS") or "auto")
