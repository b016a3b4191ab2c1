"""`EngineFleet`: the engines' lives. Started (or found in a standing set: rollout/standing.py),
waited for, asked for their health, memory and processes, restarted in their placement slots when
one dies (at most rollout.engine.max_restarts times over the run, each reported to `events`), and
stopped at the end (a standing set's left ready for the next run). What they generate and how
requests are dealt to them is `RolloutManager`'s (rollout/manager.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import ray
from ray.exceptions import RayActorError, RayTaskError

from rlsys.rollout.engine import ENGINE_ACTOR_CONCURRENCY, RolloutEngine
from rlsys.rollout.sglang.client import EngineAddress, EngineDied
from rlsys.rollout.sglang.server import ServerSpec
from rlsys.rollout.standing import StandingRecord, StandingSetGone, engine_handle, launch_engine, set_stands

logger = logging.getLogger(__name__)


@dataclass
class EngineCallFailed(Exception):
    """A request to engine `index` failed with `error` (the caller decides whether to restart it)."""

    index: int
    error: BaseException


def is_engine_death(error: BaseException) -> bool:
    """A dead engine actor, or an engine whose SGLang server has exited."""
    if isinstance(error, RayActorError):
        return True
    cause = getattr(error, "cause", None) if isinstance(error, RayTaskError) else error
    return isinstance(cause, EngineDied)


# Launches of one restart whose replacement dies before it is up (placed on a node being lost).
RELAUNCHES_PER_RESTART = 3


class EngineEvents(Protocol):
    """What a RolloutManager reports while it runs (a run's answers: rlsys/run/events.py)."""

    def engine_silent(self, index: int, why: str) -> None:
        """Engine `index` stopped answering (`why`), before it is replaced."""

    def engine_restarted(self, index: int) -> None:
        """Engine `index` is back: bring it to the current weights and version before its
        unfinished requests are issued again."""


# How often a standing set's replacement engine, while it starts, checks that its set still stands.
STANDING_CHECK_S = 5.0


class EngineRestartLimit(RuntimeError):
    """An engine died after rollout.engine.max_restarts restarts were used up."""


class EngineFleet:
    """The run's engines, `num_engines` of them: started in their placement slots (`actor_options`)
    or, with `standing`, a standing set's. A dead one is restarted in its slot (at most
    `max_restarts` times over the run) and reported to `events` (`EngineEvents`)."""

    def __init__(self, spec: ServerSpec, num_engines: int, log_dir: str, actor_options: list[dict],
                 standing: StandingRecord | None = None, hangs_dir: str | None = None,
                 events: EngineEvents | None = None):
        self.spec = spec
        self.log_dir = log_dir
        self.hangs_dir = hangs_dir  # a silent engine's stacks go there before it is stopped
        self.actor_options = actor_options
        # A standing set's engines (rollout/standing.py): used, restarted in their named slots, never stopped.
        self.standing = standing
        self.max_restarts = spec.engine.max_restarts
        self.restarts = 0
        self.launched_after = [0] * num_engines  # per slot: self.restarts when its engine was started
        self.events = events
        if standing is None:
            self.engines = [self._launch(index) for index in range(num_engines)]
            # Servers start in the background; call wait_ready() before using them.
            self._starting = [e.start.remote(spec.engine.startup_timeout_s) for e in self.engines]
        else:
            self.engines = [engine_handle(standing, index) for index in range(num_engines)]
            self._starting = [e.address.remote() for e in self.engines]
        self.addresses: list[EngineAddress] = []

    def _launch(self, index: int):
        if self.standing is not None:
            return launch_engine(self.standing, index)
        return ray.remote(RolloutEngine).options(max_concurrency=ENGINE_ACTOR_CONCURRENCY,
                                                 **self.actor_options[index]).remote(
            self.spec, f"engine-{index}", f"{self.log_dir}/engine_{index}.log", self.hangs_dir)

    def wait_ready(self) -> list[EngineAddress]:
        if not self.addresses:
            self.addresses = ray.get(self._starting)
        return self.addresses

    def recover(self, index: int, error: BaseException) -> None:
        """Restart engine `index` after `error` if that is what it was; otherwise re-raise."""
        if not is_engine_death(error):
            raise error
        self.restart(index, f"{getattr(error, 'cause', None) or error}")

    def restart(self, index: int, reason: str) -> None:
        """A fresh engine in the dead one's slot, then `events.engine_restarted(index)`."""
        if self.standing is not None and not set_stands(self.standing.name):
            raise self._set_gone(index)  # `rlsys engines down --force` under this run: nothing to restart in
        if self.restarts >= self.max_restarts:
            raise EngineRestartLimit(
                f"engine-{index} died and its {self.max_restarts} restarts (rollout.engine.max_restarts) are used "
                f"up: {reason}"
            )
        node = f"node {self.addresses[index].host}: " if index < len(self.addresses) else ""
        silent = self._silence(index)
        logger.warning("engine-%d died; restarting it (%d of %d): %s%s", index, self.restarts + 1, self.max_restarts,
                       node, f"stopped after {silent}" if silent else reason.splitlines()[0] if reason else "")
        if silent and self.events is not None:
            self.events.engine_silent(index, silent)
        self.restarts += 1
        self.launched_after[index] = self.restarts
        self.stop_engine(self.engines[index])
        self.addresses[index] = self._relaunch(index)
        logger.info("engine-%d is back, on node %s", index, self.addresses[index].host)
        if self.events is not None:
            self.events.engine_restarted(index)

    def _silence(self, index: int) -> str | None:
        """Why engine `index`'s watchdog stopped its server (it stopped answering), if it did."""
        try:
            return ray.get(self.engines[index].silence.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - its actor is gone too: it did not go silent, it died
            return None

    def _relaunch(self, index: int) -> EngineAddress:
        """A fresh engine in slot `index`'s placement: where the dead engine was, or, when that node
        is gone, wherever Ray moved the bundle (a node with room for it). A lost node is declared
        dead only after its missed heartbeats, well after its engine's actor died, so the first
        replacement may be placed on it and be cancelled before it runs (ActorDiedError: "the actor's
        node was terminated"); it is launched again, as part of the same restart, once Ray has moved
        the bundle."""
        for attempt in range(1, RELAUNCHES_PER_RESTART + 1):
            self.engines[index] = self._launch(index)
            spec = self.standing.spec if self.standing is not None else self.spec
            try:
                return self._started(index, self.engines[index].start.remote(spec.engine.startup_timeout_s))
            except RayActorError as error:
                if attempt == RELAUNCHES_PER_RESTART:
                    raise
                logger.info("engine-%d's replacement was lost before it was up (%s); launching it again", index,
                            str(error).splitlines()[0])
        raise AssertionError("unreachable")

    def _started(self, index: int, start) -> EngineAddress:
        """The address `start` (an engine's start call) returns. A standing set's engine is waited for
        while its set stands: a set stopped under the run removes the placement the replacement
        waits for, and it would wait for ever."""
        if self.standing is None:
            return ray.get(start)
        while True:
            ready, _ = ray.wait([start], timeout=STANDING_CHECK_S)
            if ready:
                return ray.get(start)
            if not set_stands(self.standing.name):
                ray.kill(self.engines[index])
                raise self._set_gone(index)

    def _set_gone(self, index: int) -> StandingSetGone:
        return StandingSetGone(
            f"the standing engines {self.standing.name!r} this run is attached to were stopped (`rlsys engines "
            f"down --force`, or their Ray cluster went away): engine-{index} is gone with them; start them again "
            f"(`rlsys engines up CONFIG --name {self.standing.name}`) and resume the run (--resume)")

    def dead_engines(self) -> list[int]:
        """Engines whose actor or server is gone (one quick round of health checks)."""
        return [report["index"] for report in self.health() if not report["alive"]]

    def server_processes(self, timeout_s: float = 10.0) -> list[tuple[int, int | None, str, str] | None]:
        """Per engine: (index, server pid, node id, node address), None for an engine whose actor
        does not answer within `timeout_s` (its actor answers while its server is stuck)."""
        calls = [engine.process.remote() for engine in self.engines]
        found = []
        for index, call in enumerate(calls):
            try:
                found.append((index, *ray.get(call, timeout=timeout_s)))
            except Exception:  # noqa: BLE001 - a dead or stuck actor: its stacks cannot be read
                found.append(None)
        return found

    def score(self, sequences: list[list[int]], engine_index: int = 0) -> list[list[float]]:
        return ray.get(self.engines[engine_index].score.remote(sequences))

    def score_with_images(self, sequence: list[int], images: tuple[bytes, ...],
                          engine_index: int = 0) -> tuple[list[int], list[float]]:
        return ray.get(self.engines[engine_index].score_with_images.remote(sequence, images))

    def health(self, timeout_s: float = 10.0) -> list[dict]:
        """Per engine: alive, memory_bytes, url; a dead or unresponsive actor reads as not alive."""
        reports = []
        for index, engine in enumerate(self.engines):
            try:
                report = ray.get(engine.health.remote(), timeout=timeout_s)
            except Exception as error:  # noqa: BLE001 - the actor itself may be gone
                report = {"alive": False, "memory_bytes": None, "url": "", "error": str(error)[:200]}
            reports.append({"index": index, **report})
        return reports

    def memory(self) -> list[dict]:
        """Per engine: device bytes (None on CPU), host RSS of its processes, released regions."""
        return self._on_every_engine("memory")

    def release_memory(self, tags: list[str]) -> list[dict]:
        """Every engine gives the tagged regions back to the device; their memory reports."""
        return self._on_every_engine("release_memory", list(tags))

    def resume_memory(self, tags: list[str]) -> list[dict]:
        """Every engine takes back those of the tagged regions it had released."""
        return self._on_every_engine("resume_memory", list(tags))

    def _on_every_engine(self, method: str, *args) -> list:
        """`method` on every engine; an engine found dead is restarted (brought up to date by
        `events.engine_restarted`) and asked again."""
        calls = [getattr(engine, method).remote(*args) for engine in self.engines]
        answers = []
        for index, call in enumerate(calls):
            try:
                answers.append(ray.get(call))
            except (RayActorError, RayTaskError) as error:
                self.recover(index, error)
                answers.append(ray.get(getattr(self.engines[index], method).remote(*args)))
        return answers

    def restart_random_streams(self, seed: int) -> None:
        """Every engine's sampling stream restarted at `seed` (a run attached to standing engines,
        after its first weight push: its samples then follow from its seed alone)."""
        self._on_every_engine("restart_random_stream", seed)

    def end_abandoned_weight_updates(self) -> list[bool]:
        """After a trainer rank died mid-sync: close the weight-update session it left open."""
        return self._on_every_engine("end_abandoned_weight_update")

    def weight_versions(self) -> list[int]:
        return ray.get([e.weight_version.remote() for e in self.engines])

    @staticmethod
    def stop_engine(engine) -> None:
        try:
            ray.get(engine.shutdown.remote(), timeout=60)
        except Exception:  # noqa: BLE001 - kill the actor even if its server is already gone
            pass
        ray.kill(engine)

    def shutdown(self) -> None:
        """Stop the engines; a standing set's are left running and ready for the next run instead."""
        if self.standing is not None:
            self._leave_ready()
        else:
            for engine in self.engines:
                self.stop_engine(engine)
        self.engines = []

    def _leave_ready(self) -> None:
        for index, engine in enumerate(self.engines):
            try:
                ray.get(engine.make_ready.remote(), timeout=60)
            except Exception as error:  # noqa: BLE001 - a dead one is restarted by the next run that attaches
                logger.warning("standing engine-%d could not be left ready: %s", index,
                               str(getattr(error, "cause", None) or error).splitlines()[0])
