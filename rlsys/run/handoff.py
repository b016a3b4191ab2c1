"""Colocated trainer and engines take turns on each GPU; this module owns the order of turns.

    generate (engines hold weights + KV cache; trainer asleep, holding ~nothing)
    -> engines release weights, KV cache, CUDA graphs  -> trainer wakes and trains
    -> trainer empties its cache (the train step's activations and gradients)
    -> engines take their weights back                  -> weight sync into them
    -> (checkpoint) -> trainer sleeps, drops its staging buffer, empties its cache
    -> engines take their KV cache back

The KV cache, the largest region, returns only after the trainer has left the device, and the
engines' weights only after the trainer's train-step peak has been returned to the device, so the
peak of a step is max(trainer training, trainer weights + optimizer + engine weights + staging
buffer, engine weights + KV cache), not their sum (the order verl and slime use). With sleeping
trainers off, or disaggregated, every call is a no-op. Each turn is written to
logs/device_handoff.jsonl with the bytes each side holds afterwards (device memory on GPU; process
RSS on CPU, where release frees nothing).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the checks below run without Ray (deploy/gpu_smoke.sh reads a finished run's metrics)
    from rlsys.actors.group import TrainerGroup
    from rlsys.rollout.fleet import EngineFleet

WEIGHTS, KV_CACHE, CUDA_GRAPH = "weights", "kv_cache", "cuda_graph"  # SGLang's memory tags
ALL_REGIONS = (WEIGHTS, KV_CACHE, CUDA_GRAPH)

# Share of its weights + KV cache that a released engine must have given back. The engine's figures
# are the GPU's memory in use, device-wide (rollout/engine.py: memory), so CUDA contexts, cuBLAS and
# NCCL workspaces and the sleeping trainer stay in both: with a ~0.2 GB model they outweigh what the
# engine frees, and no ratio of the two totals tells a working release from a failed one. What the
# release must free is known (the engine reports it); 0.9 of it leaves room for the allocator's
# granularity and SGLang's GiB figures rounded to 1 MB.
ENGINE_RELEASE_SHARE = 0.9
# A sleeping trainer rank's reservation against its awake one. Both are its own process's caching
# allocator (torch.cuda.memory_reserved), which holds no CUDA context and no other process's memory:
# asleep, only what the offload leaves (buffers, workspaces) stays, far below half of an awake rank's
# parameters, gradients and optimizer state.
TRAINER_SLEEP_SHARE = 0.5


def _engines_held(reports: list[dict]) -> int | None:
    """The most any engine holds (per GPU is what can run out): device bytes, else host RSS."""
    held = [r["device_bytes"] if r.get("device_bytes") is not None else r.get("host_bytes") for r in reports]
    held = [h for h in held if h is not None]
    return max(held) if held else None


def _engines_releasable(reports: list[dict]) -> int | None:
    """The least any engine must give back at a release (the engines of a run are alike), or None."""
    releasable = [r["releasable_bytes"] for r in reports if r.get("releasable_bytes") is not None]
    return min(releasable) if releasable else None


def engine_gave_memory_back(row: dict) -> bool:
    """A colocated GPU step's engine release freed its weights and KV cache, from its metrics row:
    serving - released >= ENGINE_RELEASE_SHARE x (weights + KV cache), all device bytes."""
    serving, released = row.get("memory_engine_serving_bytes"), row.get("memory_engine_released_bytes")
    releasable = row.get("memory_engine_releasable_bytes")
    if serving is None or released is None or not releasable:
        return False
    return serving - released >= ENGINE_RELEASE_SHARE * releasable


def trainer_gave_memory_back(row: dict) -> bool:
    """A colocated GPU step's trainer sleep freed its state, from its metrics row:
    asleep < TRAINER_SLEEP_SHARE x awake (the rank's own reservations)."""
    awake, asleep = row.get("memory_trainer_awake_bytes"), row.get("memory_trainer_asleep_bytes")
    if not awake or asleep is None:
        return False
    return asleep < TRAINER_SLEEP_SHARE * awake


@dataclass
class DeviceHandoff:
    trainer: TrainerGroup
    engines: EngineFleet
    enabled: bool  # topology.trainers_sleep
    log_path: Path | None = None
    step: int = -1
    events: list[str] = field(default_factory=list)  # this process's record, newest last

    def to_trainer(self, step: int | None = None) -> dict:
        """Engines release everything, then the trainer wakes (before a train phase); what it moved,
        as the step's metrics."""
        if not self.enabled:
            return {}
        serving = self.engines.memory()
        released = self.engines.release_memory(list(ALL_REGIONS))
        self._record("engines_release", step, engines=released)
        report = self.trainer.wake_up()
        self._record("trainer_wake", step, trainer=report)
        return {"memory_engine_serving_bytes": _engines_held(serving),
                "memory_engine_releasable_bytes": _engines_releasable(serving),
                "memory_engine_released_bytes": _engines_held(released),
                "offload_bytes": report["bytes"], "memory_trainer_awake_bytes": report["held_bytes"]}

    def weights_to_engines(self, step: int | None = None) -> None:
        """The trainer returns its train step's cached blocks to the device, then the engines take
        their weight memory back so that a sync can write into it (the caching allocator would
        otherwise keep the step's activations and gradients reserved beside them)."""
        if self.enabled:
            self._record("trainer_release_cache", step, trainer=self.trainer.release_cached_memory())
            self._record("engines_resume_weights", step, engines=self.engines.resume_memory([WEIGHTS]))

    def to_engines(self, step: int | None = None) -> dict:
        """Trainer sleeps and empties its cache, then the engines take everything back; what the
        trainer still holds asleep, as the step's metrics."""
        if not self.enabled:
            return {}
        report = self.trainer.sleep()
        self._record("trainer_sleep", step, trainer=report)
        self._record("engines_resume_all", step, engines=self.engines.resume_memory(list(ALL_REGIONS)))
        return {"memory_trainer_asleep_bytes": report["held_bytes"]}

    def _record(self, event: str, step: int | None, engines: list[dict] | None = None,
                trainer: dict | None = None) -> None:
        """`event` in this process's record and the hand-off log, under `step` (None: the step of
        the turn before it: the later turns of a step are recorded under it)."""
        self.events.append(event)
        if step is not None:
            self.step = step
        if self.log_path is None:
            return
        entry = {"time": time.time(), "step": self.step, "event": event}
        if engines is not None:
            entry["engines"] = engines
        if trainer is not None:
            entry["trainer"] = trainer
        with self.log_path.open("a") as log:
            log.write(json.dumps(entry) + "\n")
