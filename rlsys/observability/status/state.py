"""`RunStatus`: the live state of a run that the status server reads and its control calls set.

The coordinator thread writes it; the server thread reads it. One lock guards everything, and
every read returns copies, so neither side sees a half-updated step. A snapshot is kept in
RUN_DIR/status.json so `rlsys serve RUN_DIR` can show a finished run.
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

PHASES = ("starting", "rollout", "training", "syncing", "evaluating", "checkpointing", "paused",
          "finished", "stopped", "failed")


@dataclass
class ActorHealth:
    name: str
    kind: str  # "trainer" | "engine"
    alive: bool
    last_heartbeat: float | None = None
    memory_bytes: int | None = None
    detail: str = ""


@dataclass
class RunStatus:
    run_id: str
    total_steps: int
    run_dir: str
    state: str = "starting"
    step: int = 0  # steps finished
    weight_version: int = 0
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    earlier_s: float = 0.0  # seconds the run's earlier processes ran (a resumed run), before started_at
    first_started_at: float | None = None  # a resumed run: when its first process started (started_at: this one)
    error: str | None = None
    metrics: list[dict] = field(default_factory=list)
    actors: list[ActorHealth] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    dataset: dict = field(default_factory=dict)  # prompt counts, rows skipped, prompts too long
    # control requests, set by the server and consumed by the coordinator at step boundaries
    pause_requested: bool = False
    stop_requested: bool = False
    checkpoint_requested: bool = False
    latest_hang: str | None = None  # the latest directory of stack dumps (RUN_DIR/hangs/...)
    samples: list[dict] = field(default_factory=list)  # the latest answers shown (rlsys/observability/samples.py)
    status_url: str | None = None  # where the status server answers (`rlsys stacks RUN_DIR` reads it)
    # () -> every process's stacks (rlsys/run/hangs.py), None unless the run's processes are up
    stacks_provider: Callable[[], dict | None] | None = field(default=None, repr=False, compare=False)
    version: int = 0  # bumped by every change, so readers can cache what they built from it
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)

    # ---- writes (coordinator) -----------------------------------------------------------
    def set_state(self, state: str) -> None:
        if state not in PHASES:
            raise ValueError(f"unknown run state {state!r}")
        with self._lock:
            self.version += 1
            self.state = state
            if state in ("finished", "stopped", "failed"):
                self.finished_at = time.time()

    def record_step(self, row: dict) -> None:
        with self._lock:
            self.version += 1
            self.metrics.append(dict(row))
            self.step = row["step"] + 1
            self.weight_version = row.get("synced_weight_version", self.weight_version)
            if row.get("time_step_s") is not None:
                self.step_seconds.append(row["time_step_s"])

    def record_samples(self, rows: list[dict]) -> None:
        """Answers of a step (and its evals) to show: the latest SHOWN_IN_STATUS are kept."""
        from rlsys.observability.samples import SHOWN_IN_STATUS

        with self._lock:
            self.version += 1
            self.samples = (self.samples + [dict(row) for row in rows])[-SHOWN_IN_STATUS:]

    def latest_samples(self) -> list[dict]:
        with self._lock:
            return [dict(row) for row in self.samples]

    def replace_steps(self, rows: list[dict]) -> None:
        """The finished steps are exactly `rows` (after a resume drops the steps that run again)."""
        with self._lock:
            self.version += 1
            self.metrics, self.step_seconds, self.step = [], [], 0
            for row in rows:
                self.record_step(row)

    def set_actors(self, actors: list[ActorHealth]) -> None:
        with self._lock:
            self.version += 1
            self.actors = list(actors)

    def set_latest_hang(self, directory: str) -> None:
        with self._lock:
            self.version += 1
            self.latest_hang = directory

    def fail(self, error: str) -> None:
        with self._lock:
            self.version += 1
            self.error = error
            self.set_state("failed")

    # ---- control (server) ---------------------------------------------------------------
    def request(self, what: str) -> None:
        with self._lock:
            self.version += 1
            if what == "pause":
                self.pause_requested = True
            elif what == "resume":
                self.pause_requested = False
            elif what == "stop":
                self.stop_requested = True
                self.pause_requested = False
            elif what == "checkpoint":
                self.checkpoint_requested = True
            else:
                raise ValueError(f"unknown control request {what!r}")

    def take_checkpoint_request(self) -> bool:
        with self._lock:
            requested, self.checkpoint_requested = self.checkpoint_requested, False
            return requested

    # ---- reads --------------------------------------------------------------------------
    def eta_seconds(self) -> float | None:
        with self._lock:
            if self.state in ("finished", "stopped", "failed") or not self.step_seconds:
                return None
            recent = self.step_seconds[-20:]
            return (self.total_steps - self.step) * sum(recent) / len(recent)

    def summary(self) -> dict:
        with self._lock:
            return {
                "run_id": self.run_id,
                "state": self.state,
                "step": self.step,
                "total_steps": self.total_steps,
                "weight_version": self.weight_version,
                "started_at": self.started_at,
                "finished_at": self.finished_at,
                "earlier_s": self.earlier_s,
                "first_started_at": self.first_started_at or self.started_at,
                "eta_seconds": self.eta_seconds(),
                "last_metrics": dict(self.metrics[-1]) if self.metrics else None,
                "error": self.error,
                "paused": self.pause_requested,
                "run_dir": self.run_dir,
                "dataset": dict(self.dataset),
                "latest_hang": self.latest_hang,
                "status_url": self.status_url,
            }

    def metrics_since(self, since: int) -> list[dict]:
        with self._lock:
            return [dict(row) for row in self.metrics if row["step"] >= since]

    def actor_list(self) -> list[ActorHealth]:
        with self._lock:
            return list(self.actors)

    # ---- persistence --------------------------------------------------------------------
    def save_snapshot(self) -> None:
        with self._lock:
            snapshot = {**self.summary(), "actors": [asdict(a) for a in self.actors]}
        path = Path(self.run_dir) / "status.json"
        temporary = path.with_suffix(".json.tmp")
        try:
            temporary.write_text(json.dumps(snapshot))
        except OSError as error:
            temporary.unlink(missing_ok=True)
            if error.errno != errno.ENOSPC or not path.is_file():
                raise
            # A full disk: rewritten in place, in the space the old snapshot frees, so that a failed
            # run's end is still recorded (not atomic, but a stale "running" state would stay forever).
            path.write_text(json.dumps(snapshot))
            return
        os.replace(temporary, path)

    @staticmethod
    def seconds_run_so_far(run_dir: str | Path) -> float:
        """What the processes that wrote `run_dir`'s status.json ran, all together: its earlier ones'
        and the last one's, from its start to its end (or to its last snapshot, when it was killed).
        0.0 without a status.json."""
        path = Path(run_dir) / "status.json"
        try:
            snapshot = json.loads(path.read_text())
            ended = snapshot.get("finished_at") or path.stat().st_mtime
            return float(snapshot.get("earlier_s") or 0.0) + max(0.0, ended - float(snapshot["started_at"]))
        except (OSError, ValueError, KeyError, TypeError):
            return 0.0

    @staticmethod
    def first_start(run_dir: str | Path) -> float | None:
        """When the first process of the run in `run_dir` started (its status.json's record), or None."""
        try:
            snapshot = json.loads((Path(run_dir) / "status.json").read_text())
            return float(snapshot.get("first_started_at") or snapshot["started_at"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    @classmethod
    def from_run_dir(cls, run_dir: str | Path) -> RunStatus:
        """A read-only status of a run that is over (or whose coordinator is gone)."""
        from rlsys.observability.metrics import read_metrics

        run_dir = Path(run_dir)
        snapshot_path = run_dir / "status.json"
        if not snapshot_path.is_file() and not (run_dir / "metrics.jsonl").is_file():
            raise FileNotFoundError(f"{run_dir} is not a run directory (no status.json or metrics.jsonl)")
        snapshot = json.loads(snapshot_path.read_text()) if snapshot_path.is_file() else {}
        rows = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
        status = cls(
            run_id=snapshot.get("run_id", run_dir.name),
            total_steps=snapshot.get("total_steps", len(rows)),
            run_dir=str(run_dir),
            started_at=snapshot.get("started_at", time.time()),
            earlier_s=snapshot.get("earlier_s", 0.0),
            first_started_at=snapshot.get("first_started_at"),
            dataset=snapshot.get("dataset", {}),
        )
        for row in rows:
            status.record_step(row)
        from rlsys.observability.samples import SHOWN_IN_STATUS, SamplesLog

        status.record_samples(SamplesLog(run_dir / "samples.jsonl").latest(SHOWN_IN_STATUS))
        from rlsys.system.run_lock import owner_is_alive

        status.state = snapshot.get("state", "finished")
        status.finished_at = snapshot.get("finished_at")
        status.error = snapshot.get("error")
        if status.state not in ("finished", "stopped", "failed") and not owner_is_alive(run_dir):
            status.state = "failed"  # its coordinator is gone without saying so
            status.error = status.error or "the run's process is gone without finishing (killed?)"
        status.actors = [ActorHealth(**{**a, "alive": False}) for a in snapshot.get("actors", [])]
        return status
