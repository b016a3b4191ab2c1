"""Connect to the Ray cluster a job was submitted to, or start a local one."""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager

import ray

from rlsys.system.interrupts import children_in_process_groups_of_their_own

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
        # Under `ray job submit` the job's runtime env (working_dir, env vars) applies as given;
        # per-actor env vars are set where the actors are created.
        ray.init(address=address, **kwargs)
    else:
        # A local cluster keeps Ray's default token authentication; its start-up warning that token
        # auth is on (RAY_AUTH_MODE unset) asks nothing of a user of this one-process cluster.
        logger.debug("starting a local Ray cluster: %d CPUs, resources %s", local_num_cpus, local_resources or {})
        with _quiet(_RAY_AUTH_LOGGER), children_in_process_groups_of_their_own():
            ray.init(num_cpus=local_num_cpus, resources=local_resources or None, include_dashboard=False,
                     runtime_env={"env_vars": ACTOR_ENV}, **kwargs)
    try:
        yield
    finally:
        ray.shutdown()


_RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


@contextmanager
def _quiet(logger_name: str):
    logger = logging.getLogger(logger_name)
    previous = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(previous)
