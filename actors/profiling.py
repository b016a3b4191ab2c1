"""`RankProfiler`: torch.profiler over a span of steps on one trainer rank (`profile.steps`).

Started before the first profiled step and stopped after the last, so the trace holds everything
the rank did between: forward and backward passes, collectives, the weight sync, sleep and wake.
The rank's phases (`rlsys.train_step`, `rlsys.old_and_ref_logprobs`, `rlsys.backward`,
`rlsys.optimizer`, `rlsys.sync_weights`, `rlsys.sleep`, ...) are marked in it as ranges that hold
their ops. It writes a Chrome trace (open it in https://ui.perfetto.dev or chrome://tracing) and a
table of the ops that took the most time, for reading without a browser."""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager, nullcontext
from pathlib import Path

from rlsys.system.backend import Backend

# Rows of the op table: the ops that cost most; the rest are in the trace.
TABLE_ROWS = 40


class RankProfiler:
    def __init__(self, backend: Backend, rank: int):
        self.backend = backend
        self.rank = rank
        self._profile = None

    @property
    def recording(self) -> bool:
        return self._profile is not None

    def phase(self, name: str):
        """A range named `rlsys.<name>` in the trace around the block while recording; nothing
        (not even torch's record_function) otherwise."""
        if self._profile is None:
            return nullcontext()
        return _range(name)

    def start(self) -> None:
        from torch.profiler import profile

        if self._profile is not None:
            return
        if not self.backend.has_gpu:
            # Kineto looks for GPUs even when told to record the host only, and on a machine with
            # none prints "ERROR: gpuGetDeviceCount failed" (and stage lines) into the run's output.
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        # Shapes name which micro-batch an op belongs to; stacks (with_stack) would multiply the
        # trace's size and the overhead, so they are left out.
        self._profile = profile(activities=self.backend.profiler_activities(), record_shapes=True)
        self._profile.start()

    def stop(self, directory: str) -> list[str]:
        """Stop and write `trainer-rank<R>.json` (the trace) and `trainer-rank<R>-ops.txt`; their
        paths ([] when nothing was recording)."""
        if self._profile is None:
            return []
        profile, self._profile = self._profile, None
        profile.stop()
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        trace = out / f"trainer-rank{self.rank}.json"
        profile.export_chrome_trace(str(trace))
        sort_by = "self_device_time_total" if self.backend.has_gpu else "self_cpu_time_total"
        table = out / f"trainer-rank{self.rank}-ops.txt"
        table.write_text(profile.key_averages().table(sort_by=sort_by, row_limit=TABLE_ROWS) + "\n")
        return [str(trace), str(table)]


@contextmanager
def _range(name: str):
    from torch.profiler import record_function

    with record_function(f"rlsys.{name}"):
        yield


def profiled_phase(name: str):
    """Marks a TrainerWorker method as phase `name` of the rank's trace (see RankProfiler.phase)."""
    def decorate(method):
        @functools.wraps(method)
        def marked(self, *args, **kwargs):
            with self.profiler.phase(name):
                return method(self, *args, **kwargs)
        return marked
    return decorate
