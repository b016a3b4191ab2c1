"""`StepProfiler`: what `profile.steps` records, driven by the loop (rlsys/run/coordinator.py).

Before the first profiled step every trainer rank starts torch.profiler (actors/profiling.py); the
driver notes each phase of each profiled step (generate, eval, offload, train, sync, checkpoint)
with its wall-clock start. After the last profiled step (or when the run ends sooner) the ranks write
their traces and the driver its timeline, all into RUN_DIR/profile/:

    trainer-rank<R>.json      a Chrome trace of rank R (ops, collectives, CUDA kernels on a GPU)
    trainer-rank<R>-ops.txt   the ops that took the most time on rank R, as a table
    driver-timeline.json      the driver's phases per step, a Chrome trace in wall-clock microseconds

Off (profile.steps unset) the loop's calls return at once and no rank records anything.
"""

from __future__ import annotations

import json
import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

PROFILE_DIR = "profile"
TIMELINE_FILE = "driver-timeline.json"
# How long the ranks get to stop and write their traces (a trace of many steps takes seconds).
STOP_TIMEOUT_S = 300.0


class StepProfiler:
    def __init__(self, steps: tuple[int, int] | None, run_dir: Path, trainer_group):
        """`trainer_group`: a callable returning the current TrainerGroup (a rank that died is
        replaced by a new group)."""
        self.steps = steps
        self.directory = Path(run_dir) / PROFILE_DIR
        self._trainer = trainer_group
        self.recording = False
        self._spans: list[dict] = []

    def step_starting(self, step: int) -> None:
        if self.steps is None or self.recording or not self.steps[0] <= step <= self.steps[1]:
            return
        self._trainer().start_profile()
        self.recording = True
        self._spans = []
        logger.info("profiling steps %d..%d (profile.steps) into %s", step, self.steps[1], self.directory)

    @contextmanager
    def span(self, step: int, name: str):
        """Notes the block as phase `name` of `step` while recording."""
        if not self.recording:
            yield
            return
        wall, start = time.time(), time.perf_counter()
        try:
            yield
        finally:
            self._spans.append({"step": step, "name": name, "start_s": wall, "seconds": time.perf_counter() - start})

    def step_ended(self, step: int, last_step: bool) -> None:
        if self.recording and (step >= self.steps[1] or last_step):
            self.finish()

    def finish(self) -> None:
        """Stop the ranks and write everything (a run that ends before the last profiled step
        keeps what it recorded). A rank that cannot answer costs its trace, not the run."""
        if not self.recording:
            return
        self.recording = False
        written = []
        try:
            written = self._trainer().stop_profile(str(self.directory), timeout_s=STOP_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 - a dead or stuck rank: the driver's timeline is still written
            logger.warning("the trainer ranks' profiles could not be written: %s", str(error).splitlines()[0])
        try:
            written.append(str(self._write_timeline()))
        except OSError as error:  # a full disk or an unwritable run_dir: the run's own end matters more
            logger.warning("the driver's profile timeline could not be written: %s", error)
        logger.info("profile written: %s (open the .json files in https://ui.perfetto.dev)",
                    ", ".join(Path(path).name for path in written))

    def _write_timeline(self) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        events = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "rlsys driver"}}]
        for span in self._spans:
            events.append({"name": span["name"], "cat": "phase", "ph": "X", "pid": 0, "tid": 0,
                           "ts": span["start_s"] * 1e6, "dur": span["seconds"] * 1e6, "args": {"step": span["step"]}})
        path = self.directory / TIMELINE_FILE
        temporary = path.with_suffix(".json.tmp")
        temporary.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
        os.replace(temporary, path)
        return path
