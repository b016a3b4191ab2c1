"""A run's attachment to standing engines (rollout.attach): the set found, checked against the
run, leased to it, its dead engines started again in their slots, and every engine made ready."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.exceptions import RayError

from rlsys.actors.placement import Placement
from rlsys.config import RunConfig
from rlsys.rollout.standing import (
    EngineIdentity,
    Lease,
    StandingEnginesError,
    StandingRecord,
    engine_handle,
    launch_engine,
    service,
)
from rlsys.run.engine_spec import server_spec
from rlsys.system.topology import Topology

logger = logging.getLogger(__name__)


@dataclass
class Attached:
    """A run's standing engines: their record, the run's lease and the placement it uses."""

    record: StandingRecord
    lease: Lease
    placement: Placement


def attach(config: RunConfig, topology: Topology, run_dir: Path, command: str) -> Attached:
    """Standing set rollout.attach, checked against the run (StandingEnginesError naming each
    difference), leased to it, every engine alive (a dead one started again in its slot) and
    ready (nothing in flight, no update session open, memory taken back). `rlsys eval` (command
    "eval", no trainer) is checked on what the engines compute only, not on their placement."""
    name = config.rollout.attach
    record: StandingRecord = ray.get(service(name).record.remote())
    wanted = EngineIdentity.of(server_spec(config, topology, 1), topology)
    differences = record.identity.differences(wanted, placement=command != "eval")
    if differences:
        raise StandingEnginesError(
            f"rollout.attach={name}: the standing engines do not match this run:\n  - " + "\n  - ".join(differences)
            + "\nstart a set for this config (`rlsys engines up CONFIG --name OTHER`) or attach to a matching one")
    if record.spec.env != config.placement.env:
        logger.warning("placement.env differs from the standing engines' (%s): their servers keep the env of `rlsys "
                       "engines up`; this run's trainer ranks get %s", _env_text(record.spec.env),
                       _env_text(config.placement.env))
    lease = Lease.take(name, command, str(run_dir))
    try:
        revived = revive_dead_engines(record)
        states = ray.get([engine_handle(record, index).make_ready.remote()
                          for index in range(record.topology.num_engines)])
    except BaseException:
        lease.release()
        raise
    tidied = [f"engine-{i}: {', '.join(k for k, v in s.items() if v)}" for i, s in enumerate(states) if any(s.values())]
    logger.info("attached to standing engines %r (%d engine(s), logs in %s)%s%s", name, record.topology.num_engines,
                record.log_dir, f"; restarted {', '.join(f'engine-{i}' for i in revived)}" if revived else "",
                f"; left by the last run: {'; '.join(tidied)}" if tidied else "")
    return Attached(record, lease, Placement(record.placement_group, topology, owned=False))


def _env_text(env: dict[str, str]) -> str:
    return " ".join(f"{name}={value}" for name, value in sorted(env.items())) or "none"


def revive_dead_engines(record: StandingRecord) -> list[int]:
    """Start again, in its slot, each engine of the set whose actor or server is gone."""
    from rlsys.rollout.fleet import EngineFleet

    revived = []
    for index in range(record.topology.num_engines):
        try:
            engine = engine_handle(record, index)
            if ray.get(engine.health.remote(), timeout=30)["alive"]:
                continue
            EngineFleet.stop_engine(engine)
        except (ValueError, RayError):  # no actor by that name (ValueError), one dead or not answering in time
            pass
        logger.warning("standing engine-%d of %r is not running; starting it again", index, record.name)
        ray.get(launch_engine(record, index).start.remote(record.spec.startup_timeout_s))
        revived.append(index)
    return revived
