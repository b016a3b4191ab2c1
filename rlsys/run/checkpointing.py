"""Run checkpoints: RUN_DIR/checkpoints/step_NNNNNNNN/ holding the trainer's DCP shards, each
rank's scheduler and RNG state, coordinator.json (next step, data position, weight version) and
step_record.json (the metrics row and shown samples of the step it closes, for a run killed between
the checkpoint and the row's append to metrics.jsonl).
Nothing in one pins the trainer's layout: it resumes on another rank count or context-parallel
split (actors/checkpoint.py); what coordinator.json holds is the driver's alone.

A checkpoint is written into a temporary sibling directory and renamed into place only when
every part is on disk, so a crash mid-save leaves the last good checkpoint untouched; leftover
temporary directories are ignored on resume and removed by the next save.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from rlsys.errors import RunFailed

logger = logging.getLogger(__name__)

_FINAL = re.compile(r"^step_(\d{8})$")
STATE_FILE = "coordinator.json"
STEP_RECORD_FILE = "step_record.json"


@dataclass
class StepRecord:
    """What a step leaves in metrics.jsonl and samples.jsonl, as it stood when its checkpoint was
    taken (the checkpoint's own time and the whole step's time are not known yet)."""
    row: dict
    samples: list[dict]


@dataclass
class CoordinatorState:
    next_step: int
    weight_version: int
    data_epoch: int
    data_index: int
    python_random_state: list | None = None
    # rollout.mode partial: the groups in flight after step `next_step - 1` (rollout/partial.py's
    # JSON form), set when a checkpoint is taken
    partial_groups: list | None = None

    def finish_step(self, step: int, data_epoch: int, data_index: int) -> None:
        """`step` is done and its weights are on the engines (one version newer)."""
        self.next_step, self.data_epoch, self.data_index = step + 1, data_epoch, data_index
        self.weight_version += 1


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointStore:
    def __init__(self, run_dir: Path, keep_last: int = 2):
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last

    def path_for(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def complete_checkpoints(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if _FINAL.match(p.name) and (p / STATE_FILE).is_file()]
        return sorted(found, key=lambda p: int(_FINAL.match(p.name).group(1)))

    def has(self, step: int) -> bool:
        return (self.path_for(step) / STATE_FILE).is_file()

    def latest(self) -> Path | None:
        complete = self.complete_checkpoints()
        return complete[-1] if complete else None

    def latest_loadable(self) -> tuple[Path | None, list[tuple[Path, str]]]:
        """The latest checkpoint whose trainer state is whole (`trainer_state_problem`), and the
        later ones passed over, newest first, each with why: files cut short after the save (a copy
        interrupted, a disk filled by something else)."""
        passed_over = []
        for checkpoint in reversed(self.complete_checkpoints()):
            problem = trainer_state_problem(checkpoint)
            if problem is None:
                return checkpoint, passed_over
            passed_over.append((checkpoint, problem))
        return None, passed_over

    def save(self, step: int, write_trainer_state: Callable[[str], None], state: CoordinatorState,
             record: StepRecord | None = None) -> Path:
        """Write a checkpoint named after `step` (the number of finished steps) atomically, with
        `record`, the step's metrics row and shown samples, when they are not logged yet."""
        self.root.mkdir(parents=True, exist_ok=True)
        for partial in self.root.glob("*.tmp-*"):
            shutil.rmtree(partial, ignore_errors=True)
        temporary = self.root / f"step_{step:08d}.tmp-{uuid.uuid4().hex[:8]}"
        temporary.mkdir()
        try:
            write_trainer_state(str(temporary))
            if record is not None:
                (temporary / STEP_RECORD_FILE).write_text(json.dumps(asdict(record)))
            state_path = temporary / STATE_FILE
            with state_path.open("w") as handle:  # written last: its presence marks a whole checkpoint
                json.dump(asdict(state), handle)
                handle.flush()
                os.fsync(handle.fileno())
        except BaseException:
            shutil.rmtree(temporary, ignore_errors=True)  # on a full disk, gives the space back at once
            raise
        final = self.path_for(step)
        if final.exists():
            shutil.rmtree(final)
        os.rename(temporary, final)
        _fsync_dir(self.root)
        for old in self.complete_checkpoints()[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    @staticmethod
    def load_state(checkpoint: Path) -> CoordinatorState:
        return CoordinatorState(**json.loads((Path(checkpoint) / STATE_FILE).read_text()))

    @staticmethod
    def load_step_record(checkpoint: Path) -> StepRecord | None:
        """The record saved with `checkpoint`; None when it has none (taken at a stop, after the
        step was logged, or by an rlsys before 2026-12-05)."""
        path = Path(checkpoint) / STEP_RECORD_FILE
        if not path.is_file():
            return None
        return StepRecord(**json.loads(path.read_text()))


def trainer_state_problem(checkpoint: Path) -> str | None:
    """Why the trainer state (DCP shards) in `checkpoint` cannot be loaded: its index missing or
    unreadable, a shard missing or shorter than the index says (a copy cut short, a full disk);
    None when every byte the index points at is there."""
    from torch.distributed.checkpoint import FileSystemReader

    directory = Path(checkpoint) / "dcp"
    if not directory.is_dir():
        return "it has no dcp/ directory"
    try:
        metadata = FileSystemReader(str(directory)).read_metadata()
    except Exception as error:  # noqa: BLE001 - any unreadable index means the same to the user
        return f"its index dcp/.metadata cannot be read ({type(error).__name__}: {error})"
    needed: dict[str, int] = {}
    for item in metadata.storage_data.values():
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
    for name, size in sorted(needed.items()):
        shard = directory / name
        if not shard.is_file():
            return f"dcp/{name} is missing"
        if shard.stat().st_size < size:
            return f"dcp/{name} is truncated ({shard.stat().st_size} of {size} bytes)"
    return None


def checkpoint_to_resume(store: CheckpointStore) -> Path | None:
    """The checkpoint `--resume` continues from: the latest loadable one, saying in one line which
    later ones it passes over and why (loading one would fail on every trainer rank after Ray and
    the engines started). None when there is no checkpoint; a ConfigError when none is loadable."""
    from rlsys.config import ConfigError

    checkpoint, passed_over = store.latest_loadable()
    reasons = "; ".join(f"{path} is incomplete ({why})" for path, why in passed_over)
    if passed_over and checkpoint is None:
        raise ConfigError(f"no checkpoint in {store.root} can be resumed: {reasons}; copy the run directory "
                          "again, or start over in another run_dir")
    if passed_over:
        logger.warning("%s; resuming from %s, the latest complete checkpoint", reasons, checkpoint.name)
    return checkpoint


def python_random_state() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def restore_python_random_state(state: list | None) -> None:
    if state is not None:
        random.setstate((state[0], tuple(state[1]), state[2]))


class Checkpointer:
    """When to checkpoint, and taking one: every `checkpoint.interval` steps and at the last
    step, when the status API asks, and before a requested stop (API or SIGTERM), so a stopped
    run can always be resumed."""

    def __init__(self, store: CheckpointStore, interval: int, total_steps: int, parts,
                 partial_groups: Callable[[], list] | None = None):
        self.store = store
        self.interval = interval
        self.total_steps = total_steps
        self.parts = parts  # the trainer group may be replaced (auto-resume): looked up at save time
        # rollout.mode partial: the groups in flight, serialised only when a checkpoint is taken
        # (they can hold many tokens: not every step)
        self.partial_groups = partial_groups

    def due(self, finished_steps: int, requested: bool, stopping: bool, last_step: bool = False) -> bool:
        """`last_step`: the run ends with this step (its total, or eval.stop_at_reward reached)."""
        on_schedule = self.interval and (finished_steps % self.interval == 0 or finished_steps == self.total_steps
                                         or last_step)
        return bool(on_schedule or requested or stopping)

    def save(self, state: CoordinatorState, record: StepRecord | None = None) -> Path:
        state.python_random_state = python_random_state()
        state.partial_groups = self.partial_groups() if self.partial_groups else None
        return self.store.save(state.next_step, self.parts.trainer.save_checkpoint, state, record)


_SHORT_WRITE_MARKS = ("inline_container.cc", "PytorchStreamWriter failed writing file")


def disk_full_failure(error: BaseException, run_dir: Path) -> RunFailed | None:
    """A RunFailed naming the full file system, its free space and the checkpoint a resume starts
    from, when `error` comes from a disk with no space left (directly, from an actor or in its
    chain of causes); None otherwise."""
    import errno
    import shutil

    found, pending, seen = None, [error], set()
    while pending and found is None:
        error = pending.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            found = error
        # torch.save's zip writer (caffe2 inline_container.cc) reports a short write to a full disk
        # as a RuntimeError, "unexpected pos N vs M" or "PytorchStreamWriter failed writing file"
        if isinstance(error, RuntimeError) and any(mark in str(error) for mark in _SHORT_WRITE_MARKS):
            found = error
        # Ray's wrapper of an actor's exception keeps it in `cause`; DCP's CheckpointException keeps
        # each rank's (exception, traceback) in `failures`
        failures = getattr(error, "failures", None)
        pending += [getattr(error, "cause", None), error.__cause__, error.__context__]
        pending += [pair[0] for pair in failures.values()] if isinstance(failures, dict) else []
    if found is None:
        return None
    filename = getattr(found, "filename", None)
    writing = f" (writing {filename})" if filename else ""
    usage = shutil.disk_usage(run_dir)  # after the writers removed their partial files
    latest = CheckpointStore(run_dir).latest()
    then = f"then --resume continues from {latest}" if latest else "no checkpoint was written yet"
    return RunFailed(f"no space left on the device of {run_dir}{writing}: {usage.free / 2**20:.1f} MiB free of "
                     f"{usage.total / 2**20:.1f} MiB there; free some space, {then}")
