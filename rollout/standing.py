"""Standing engines: SGLang engines that outlive a run (`rlsys engines up|status|down`), and what a
run (`rollout.attach: NAME`) needs to use them: the check that they serve the run's model as the run
would place it, a lease so one run at a time uses them, and the engine slots a run restarts a dead
engine into.

Ray owns their lifetime. A standing set NAME is, in the Ray namespace SERVICE_NAMESPACE:
- a detached placement group laid out as a run of the same config lays out its own (trainer
  bundles too: colocated, trainer rank i shares engine i's bundle, so an attached run puts its
  ranks in these bundles, as an owned run does in its own);
- one detached `RolloutEngine` actor per engine, named `NAME/engine-I`, each owning its SGLang
  server (its reaper stops the server if the actor dies);
- a detached `EngineService` actor named `NAME`, holding the set's record (what it serves, where,
  its log directory) and the lease. A lease not renewed for LEASE_TTL_S is free again: a run
  killed without warning cannot hold the engines forever.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import ray
from ray.exceptions import RayActorError
from ray.util.placement_group import PlacementGroup

from rlsys.errors import RunFailed
from rlsys.rollout.engine import ENGINE_ACTOR_CONCURRENCY, RolloutEngine
from rlsys.rollout.sglang.server import ServerSpec
from rlsys.system.topology import Topology

logger = logging.getLogger(__name__)

SERVICE_NAMESPACE = "rlsys-engines"
# A lease not renewed for this long is free; a run renews its lease every LEASE_RENEW_S.
LEASE_TTL_S = 30.0
LEASE_RENEW_S = 5.0
# The model's config.json keys that do not change what the engine computes or what it is sent:
# where it was saved from, with which transformers, and the dtype (compared as the engine's dtype).
# (initializer_range only drew the first weights, which the run replaces with its own.)
_UNCOMPARED_MODEL_KEYS = frozenset({"_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache",
                                    "initializer_range"})
# The tokenizer's files: a run's token ids and stop strings mean the same to the engine only if equal.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
                    "tokenizer.model", "added_tokens.json", "chat_template.jinja")


class StandingEnginesError(RunFailed):
    """A standing set is missing, in use, or does not match the run (the message says what to do)."""


@dataclass(frozen=True)
class EngineIdentity:
    """What a run and the engines it attaches to must share: the model the engines compute (its
    config.json, tokenizer and dtype), the engines' own shape, and the placement they sit in."""

    model: dict
    tokenizer: str  # sha256 over the tokenizer's files
    dtype: str
    tp_size: int
    context_length: int
    skip_tokenizer_init: bool
    extra_args: tuple[str, ...]  # rollout.engine.extra_args: SGLang options that may change what it computes
    mode: str
    num_ranks: int
    num_engines: int
    has_gpu: bool
    memory_saver: bool  # started with SGLang's memory saver (a colocated GPU run's hand-off needs it)
    return_routes: bool = False  # returns each token's experts (rollout.routing_replay)
    trainer_resources: dict = field(default_factory=dict)
    engine_resources: dict = field(default_factory=dict)

    @classmethod
    def of(cls, spec: ServerSpec, topology: Topology) -> EngineIdentity:
        return cls(
            model=model_signature(spec.model.path), tokenizer=tokenizer_digest(spec.model.tokenizer_dir),
            dtype=spec.dtype, tp_size=spec.engine.tp_size, context_length=spec.engine.context_length,
            skip_tokenizer_init=spec.engine.skip_tokenizer_init, extra_args=tuple(spec.engine.extra_args),
            mode=topology.mode, num_ranks=topology.num_ranks,
            num_engines=topology.num_engines, has_gpu=topology.has_gpu,
            memory_saver=spec.memory_saver and topology.has_gpu, return_routes=spec.return_routes,
            trainer_resources=dict(topology.trainer_resources), engine_resources=dict(topology.engine_resources))

    def differences(self, run: EngineIdentity, placement: bool = True) -> list[str]:
        """What the run (`run`) would need that these engines do not give, one line each; [] when none.
        Without `placement`, only what the engines compute (`rlsys eval`: no trainer to place)."""
        lines = []
        for key in sorted(set(self.model) | set(run.model)):
            if self.model.get(key) != run.model.get(key):
                lines.append(f"model config.json {key}: the engines' {self.model.get(key)!r}, "
                             f"the run's {run.model.get(key)!r}")
        if self.tokenizer != run.tokenizer:
            lines.append("the tokenizer's files differ (model.tokenizer_path or model.path)")
        fields = (("dtype", "engine dtype (model.dtype; bfloat16 on GPUs)"), ("tp_size", "rollout.engine.tp_size"),
                  ("context_length", "rollout.engine.context_length"),
                  ("skip_tokenizer_init", "rollout.engine.skip_tokenizer_init"),
                  ("extra_args", "rollout.engine.extra_args"), ("mode", "placement.mode"),
                  ("num_ranks", "trainer.num_ranks (the trainer bundles of the engines' placement)"),
                  ("num_engines", "rollout.num_engines"), ("has_gpu", "GPUs used"),
                  ("trainer_resources", "placement.trainer_node_resources"),
                  ("engine_resources", "placement.engine_node_resources"))
        placement_fields = {"mode", "num_ranks", "num_engines", "trainer_resources", "engine_resources"}
        for name, label in fields:
            if not placement and name in placement_fields:
                continue
            if getattr(self, name) != getattr(run, name):
                lines.append(f"{label}: the engines' {getattr(self, name)!r}, the run's {getattr(run, name)!r}")
        if placement and run.memory_saver and not self.memory_saver:
            lines.append("the run hands the GPU between trainer and engines (colocated, sleeping trainers): the "
                         "engines were started without SGLang's memory saver")
        if run.return_routes and not self.return_routes:
            lines.append("the run replays the engines' expert routing (rollout.routing_replay: rollout): the engines "
                         "were started without returning it; start them from a config with routing_replay: rollout")
        return lines


def model_signature(model_path: str) -> dict:
    """The model's config.json without the keys that do not change what it computes."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    return {key: value for key, value in config.items() if key not in _UNCOMPARED_MODEL_KEYS}


def tokenizer_digest(tokenizer_dir: str) -> str:
    digest = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        path = Path(tokenizer_dir) / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@dataclass(frozen=True)
class StandingRecord:
    """What `rlsys engines up` started, kept by the set's EngineService actor."""

    name: str
    identity: EngineIdentity
    spec: ServerSpec  # how each engine was started (a restart starts it the same way)
    topology: Topology
    placement_group: PlacementGroup
    log_dir: str
    model_path: str
    started_at: float
    started_by: str  # host and pid of the `rlsys engines up` that started them
    engine_options: tuple[dict, ...] = ()  # Ray options of each engine's actor (its bundle)
    ray_started_here: bool = False  # `engines up` started this machine's Ray cluster: `engines down` stops it
    # The set keeps the trainer ranks of the runs that attach to it between them (actors/warm_ranks.py).
    warm_trainers: bool = True

    def engine_name(self, index: int) -> str:
        return f"{self.name}/engine-{index}"


@dataclass(frozen=True)
class LeaseHolder:
    """Who holds a set's lease (for the refusal a second run gets)."""

    run_dir: str
    host: str
    pid: int
    command: str  # "train" or "eval"
    # Which process that pid is (its start_key: rlsys/system/process_start.py, not create_time, which moves
    # with the clock) and in which pid namespace: a later run on the same host tells a holder that is gone
    # (killed with SIGKILL: its lease is never released) from a live one.
    started: float = 0.0
    pid_namespace: int = 0

    def __str__(self) -> str:
        return f"`rlsys {self.command}` pid {self.pid} on {self.host} (run_dir {self.run_dir})"

    @classmethod
    def this_process(cls, run_dir: str, command: str) -> LeaseHolder:
        import psutil

        from rlsys.system.process_start import start_key

        return cls(run_dir=run_dir, host=socket.gethostname(), pid=os.getpid(), command=command,
                   started=start_key(psutil.Process()), pid_namespace=_pid_namespace())

    def is_gone(self) -> bool:
        """Whether this holder's process is known to have ended: it ran in this host's pid namespace and
        no process with its pid and start time is there now. False when that cannot be told from here."""
        import psutil

        from rlsys.system.process_start import start_key

        if self.host != socket.gethostname() or not self.pid_namespace or self.pid_namespace != _pid_namespace():
            return False
        try:
            return start_key(psutil.Process(self.pid)) != self.started
        except psutil.NoSuchProcess:
            return True
        except psutil.Error:
            return False


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


class EngineService:
    """The detached actor a standing set is found by: its record and its lease. Plain class,
    wrapped with `ray.remote` when the set is started. The lease's clock is this process's."""

    def __init__(self, record: StandingRecord):
        self._record = record
        self._lease: tuple[str, LeaseHolder, float, float] | None = None  # (id, holder, taken, expires)

    def record(self) -> StandingRecord:
        return self._record

    def _current(self):
        if self._lease is not None and time.monotonic() >= self._lease[3]:
            self._lease = None
        return self._lease

    def acquire(self, holder: LeaseHolder, ttl_s: float) -> tuple[str | None, dict | None]:
        """(lease id, None), or (None, the current holder's lease) when another run holds it."""
        current = self._current()
        if current is not None:
            return None, self.lease()
        lease_id = uuid.uuid4().hex
        now = time.monotonic()
        self._lease = (lease_id, holder, now, now + ttl_s)
        return lease_id, None

    def take_over(self, holder: LeaseHolder, ttl_s: float, gone: LeaseHolder) -> tuple[str | None, dict | None]:
        """`acquire`, replacing the lease in force if `gone` holds it: its process ended without
        releasing it (the caller saw that, on gone's host: LeaseHolder.is_gone)."""
        current = self._current()
        if current is not None and current[1] == gone:
            self._lease = None
        return self.acquire(holder, ttl_s)

    def renew(self, lease_id: str, ttl_s: float) -> bool:
        current = self._current()
        if current is None or current[0] != lease_id:
            return False
        self._lease = (lease_id, current[1], current[2], time.monotonic() + ttl_s)
        return True

    def release(self, lease_id: str) -> bool:
        current = self._current()
        if current is None or current[0] != lease_id:
            return False
        self._lease = None
        return True

    def lease(self) -> dict | None:
        """The lease in force: its holder, for how long it has been held, when it lapses unrenewed."""
        current = self._current()
        if current is None:
            return None
        now = time.monotonic()
        return {"holder": asdict(current[1]), "held_s": now - current[2], "expires_in_s": current[3] - now,
                "description": str(current[1])}


# ---- finding a set --------------------------------------------------------------------------

def service(name: str):
    """The EngineService actor of standing set `name`; StandingEnginesError if there is none."""
    try:
        return ray.get_actor(name, namespace=SERVICE_NAMESPACE)
    except ValueError:
        known = standing_names()
        raise StandingEnginesError(
            f"no standing engines named {name!r} in this Ray cluster "
            f"({'standing sets: ' + ', '.join(known) if known else 'none is running'}); start them with "
            f"`rlsys engines up CONFIG --name {name}`") from None


class StandingSetGone(RunFailed):
    """The standing set a run is attached to was stopped under it."""


def set_stands(name: str) -> bool:
    """Whether standing set `name` is still up (its record's actor answers to its name); False too
    when its Ray cluster cannot be asked."""
    try:
        ray.get_actor(name, namespace=SERVICE_NAMESPACE)
    except Exception:  # noqa: BLE001 - ValueError: no such actor; a gone cluster raises Ray's own errors
        return False
    return True


def standing_names() -> list[str]:
    """The standing sets of the connected Ray cluster."""
    from ray.util import list_named_actors

    return sorted(actor["name"] for actor in list_named_actors(all_namespaces=True)
                  if actor.get("namespace") == SERVICE_NAMESPACE and "/" not in actor["name"])


def engine_handle(record: StandingRecord, index: int):
    return ray.get_actor(record.engine_name(index), namespace=SERVICE_NAMESPACE)


def launch_engine(record: StandingRecord, index: int, timeout_s: float = 30.0):
    """A fresh detached engine actor for slot `index` of the set (not started). A killed actor's name
    is freed by the GCS shortly after ray.kill returns: taken again once it is."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.remote(RolloutEngine).options(
                name=record.engine_name(index), namespace=SERVICE_NAMESPACE, lifetime="detached",
                max_concurrency=ENGINE_ACTOR_CONCURRENCY, **record.engine_options[index],
            ).remote(record.spec, f"engine-{index}", f"{record.log_dir}/engine_{index}.log")
        except ValueError as error:  # "The name ... is already taken"
            if time.monotonic() >= deadline:
                raise StandingEnginesError(f"{record.engine_name(index)}: {error}") from error
            time.sleep(0.2)


# ---- a run's lease --------------------------------------------------------------------------

class Lease:
    """A run's hold on a standing set, renewed in a background thread until `release`."""

    def __init__(self, name: str, actor, lease_id: str):
        self.name, self._actor, self.lease_id = name, actor, lease_id
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="engine-lease", daemon=True)
        self._thread.start()

    @classmethod
    def take(cls, name: str, command: str, run_dir: str) -> Lease:
        actor = service(name)
        holder = LeaseHolder.this_process(run_dir, command)
        lease_id, current = ray.get(actor.acquire.remote(holder, LEASE_TTL_S))
        if lease_id is None and (gone := LeaseHolder(**current["holder"])).is_gone():
            # A run killed without warning (SIGKILL, OOM) never released its lease: resuming it at once
            # must not wait LEASE_TTL_S for the lease to lapse.
            lease_id, current = ray.get(actor.take_over.remote(holder, LEASE_TTL_S, gone))
            if lease_id is not None:
                logger.info("standing engines %r: took over the lease of %s, whose process is gone", name, gone)
        if lease_id is None:
            raise StandingEnginesError(
                f"standing engines {name!r} are in use by {current['description']}, held for "
                f"{current['held_s']:.0f} s (one run at a time per engine set; a lease not renewed for "
                f"{LEASE_TTL_S:.0f} s lapses): wait for that run to end, or start another set with "
                f"`rlsys engines up CONFIG --name OTHER`")
        return cls(name, actor, lease_id)

    def _renew(self) -> None:
        while not self._stop.wait(LEASE_RENEW_S):
            try:
                if not ray.get(self._actor.renew.remote(self.lease_id, LEASE_TTL_S), timeout=LEASE_RENEW_S * 2):
                    logger.error("the lease on standing engines %r lapsed (not renewed for %.0f s); another run "
                                 "may attach to them", self.name, LEASE_TTL_S)
            except RayActorError:
                # The set's record is gone (`rlsys engines down --force`): said once; the run fails at its
                # next engine call, naming it (EngineFleet.restart).
                logger.warning("standing engines %r were stopped while this run holds them", self.name)
                return
            except Exception as error:  # noqa: BLE001 - the set may be gone; the run finds out at its next call
                logger.warning("could not renew the lease on standing engines %r: %s", self.name,
                               str(error).splitlines()[0] if str(error) else type(error).__name__)

    def release(self) -> None:
        self._stop.set()
        self._thread.join(timeout=LEASE_RENEW_S * 3)
        try:
            ray.get(self._actor.release.remote(self.lease_id), timeout=30)
        except Exception as error:  # noqa: BLE001 - a gone set holds no lease
            logger.debug("releasing the lease on %r: %s", self.name, error)
