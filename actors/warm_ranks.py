"""Warm trainer ranks: a standing set keeps the trainer ranks of the runs that attach to it.

An attached run's engines are up before it starts; its trainer ranks were not: each is a process that
imports torch and transformers (~8-10 CPU-seconds on a 2-core machine, most of an attached run's start).
So a set keeps the ranks of the last run that attached to it, up and released (no model, optimizer,
transport or offloaded state: `TrainerWorker.release`) in the process group they formed, and the next run
whose ranks would start the same way (`WarmIdentity`) gives them its spec (`respec`, then `build`) instead
of starting new ones: the same models, optimizer, schedule and seeded RNG as new ranks would build.

A run whose call to its ranks failed (a rank died or hung, an error in a collective) stops them as a run
with ranks of its own does; the next attach starts new ones. A driver killed outright is noticed by its
ranks on its node (`TrainerWorker.serve`), which release themselves. `rlsys engines down` stops them with
the engines; `rlsys engines up --no-warm-trainers` starts a set that keeps none.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import ray

from rlsys.actors.group import TrainerEvents, TrainerGroup
from rlsys.actors.trainer import TrainerSpec
from rlsys.model.shape import ModelShape
from rlsys.rollout.standing import SERVICE_NAMESPACE, StandingSetGone, set_stands

logger = logging.getLogger(__name__)

# rlsys's packages: a rank imported them when it started (pyproject.toml maps the subpackages to folders).
_PACKAGES = ("rlsys", "rlsys.actors", "rlsys.rollout", "rlsys.weight_sync")
# How long a stopped rank's name may stay taken (the GCS frees it shortly after ray.kill).
NAME_FREED_S = 30.0


@dataclass(frozen=True)
class WarmIdentity:
    """How a set's kept ranks were started: a run reuses them only if its own would start the same way."""

    num_ranks: int
    has_gpu: bool
    env: tuple[tuple[str, str], ...]  # the ranks' runtime environment variables
    code: str  # `code_fingerprint()` of the run that started them

    @classmethod
    def of(cls, num_ranks: int, has_gpu: bool, env: dict[str, str]) -> WarmIdentity:
        return cls(num_ranks, has_gpu, tuple(sorted(env.items())), code_fingerprint())


def code_fingerprint() -> str:
    """rlsys's modules (path, size, modification time) with torch's and transformers' versions: a
    rank started before an edit or an upgrade is not warm for a run after it."""
    import hashlib

    digest = hashlib.blake2b(digest_size=16)
    for package in _PACKAGES:
        found = importlib.util.find_spec(package)
        for root in (found.submodule_search_locations or []) if found else []:
            for path in sorted(Path(root).rglob("*.py")):
                stat = path.stat()
                digest.update(f"{path}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    for distribution in ("torch", "transformers"):
        digest.update(f"{distribution}={importlib.metadata.version(distribution)};".encode())
    return digest.hexdigest()


def rank_name(set_name: str, rank: int) -> str:
    return f"{set_name}/trainer-rank-{rank}"


def _kept_names(set_name: str) -> list[str]:
    from ray.util import list_named_actors

    prefix = rank_name(set_name, 0)[:-1]
    return sorted(actor["name"] for actor in list_named_actors(all_namespaces=True)
                  if actor.get("namespace") == SERVICE_NAMESPACE and actor["name"].startswith(prefix))


def stop_warm_ranks(set_name: str) -> int:
    """Stop the ranks set `set_name` keeps, and wait until their processes (on this node) have exited
    and their names are free. How many there were."""
    import psutil

    names = _kept_names(set_name)
    pids = []
    for name in names:
        try:
            actor = ray.get_actor(name, namespace=SERVICE_NAMESPACE)
        except ValueError:
            continue
        try:
            pids.append(ray.get(actor.process.remote(), timeout=5)[0])
        except Exception:  # noqa: BLE001 - a rank that does not answer is killed all the same
            pass
        ray.kill(actor)
    deadline = time.monotonic() + NAME_FREED_S
    while time.monotonic() < deadline and (_kept_names(set_name) or any(psutil.pid_exists(pid) for pid in pids)):
        time.sleep(0.2)
    return len(names)


def _kept_ranks(set_name: str, identity: WarmIdentity) -> list | None:
    """The set's kept ranks, if every one answers and was started as `identity`; else None, once
    whichever are there are stopped (started otherwise, or some gone)."""
    handles = []
    for rank in range(identity.num_ranks):
        try:
            handles.append(ray.get_actor(rank_name(set_name, rank), namespace=SERVICE_NAMESPACE))
        except ValueError:
            break
    if len(handles) == identity.num_ranks:
        try:
            if ray.get([rank.started_as.remote() for rank in handles], timeout=60) == [identity] * len(handles):
                return handles
        except Exception:  # noqa: BLE001 - a kept rank that is gone or stuck: new ones are started
            pass
    if stopped := stop_warm_ranks(set_name):
        logger.info("standing engines %r: their %d kept trainer rank(s) were started otherwise (or some are gone); "
                    "starting new ones", set_name, stopped)
    return None


def warm_trainer_group(set_name: str, spec: TrainerSpec, num_ranks: int, options: list[dict], env: dict[str, str],
                       judge_model: Callable[[ModelShape], None] | None,
                       events: TrainerEvents | None = None) -> TrainerGroup:
    """The run's trainer group on the ranks standing set `set_name` keeps (started, and kept, if it
    keeps none that fit): released again, not stopped, when the run ends well."""
    import psutil

    from rlsys.system.node import node_address
    from rlsys.system.process_start import start_key

    if not set_stands(set_name):  # stopped under the run (`rlsys engines down --force`): nothing to keep ranks in
        raise StandingSetGone(f"the standing engines {set_name!r} this run is attached to were stopped (`rlsys "
                              "engines down --force`, or their Ray cluster went away): no trainer ranks can start in "
                              f"their placement; start them again (`rlsys engines up CONFIG --name {set_name}`) and "
                              "resume the run (--resume)")
    identity = WarmIdentity.of(num_ranks, spec.has_gpu, env)
    kept_while_it_stands = partial(set_stands, set_name)
    kept = _kept_ranks(set_name, identity)
    if kept is not None:
        group = TrainerGroup(spec, num_ranks, warm=kept, judge_model=judge_model, keep=kept_while_it_stands,
                             events=events)
        logger.info("trainer: the %d warm rank(s) standing engines %r keep take this run's model", num_ranks, set_name)
    else:
        named = [{**options[rank], "name": rank_name(set_name, rank), "namespace": SERVICE_NAMESPACE,
                  "lifetime": "detached"} for rank in range(num_ranks)]
        group = TrainerGroup(spec, num_ranks, named, env_vars=env, judge_model=judge_model, keep=kept_while_it_stands,
                             events=events)
        ray.get([rank.keep_warm.remote(identity) for rank in group.workers])
    here, driver = node_address(), psutil.Process()
    ray.get([rank.serve.remote(os.getpid() if node == here else 0, start_key(driver), set_name)
             for rank, node in zip(group.workers, group.nodes, strict=True)])
    return group
