"""A run's stack dumps: when a wait of the driver passes its bound (trainer.call_timeout_s; a weight
sync that engines did not answer within weight_sync.timeout_s) the Python stacks of the driver,
every trainer rank and every engine's server tree land in `RUN_DIR/hangs/<step>-<time>/`
(rlsys/system/stacks.py) before the run fails or recovers; the failure line names the ranks inside
a collective and those not."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict
from pathlib import Path

from rlsys.system.stacks import ProcessRef, ProcessStacks, collect_stacks, summarize

logger = logging.getLogger(__name__)


class HangReporter:
    """Knows the run's processes (`parts`: its trainer group and engines) and where dumps go."""

    def __init__(self, run_dir: Path, parts, step, status=None):
        self.hangs_dir = run_dir / "hangs"
        self.parts = parts
        self.step = step  # () -> the step the run is in
        self.status = status  # RunStatus: its latest_hang is the dashboard's link
        self.latest: Path | None = None

    def processes(self) -> list[ProcessRef]:
        import ray

        from rlsys.system.node import node_address

        here = ray.get_runtime_context().get_node_id()
        refs = [ProcessRef("driver", os.getpid(), here, node_address())]
        if self.parts.trainer is not None:
            refs += [ProcessRef(f"trainer rank {rank}", pid, node_id, address, answers_signal=True)
                     for rank, (pid, node_id, address) in enumerate(self.parts.trainer.processes)]
        if self.parts.rollout is not None:
            for engine in self.parts.rollout.fleet.server_processes():
                if engine is not None and engine[1] is not None:
                    index, pid, node_id, address = engine
                    refs.append(ProcessRef(f"engine-{index}", pid, node_id, address, with_children=True))
        return refs

    def collect(self, what: str) -> tuple[Path, list[ProcessStacks]]:
        """Every process's stacks into hangs/<step>-<time>/; (that directory, what was found)."""
        out = self.hangs_dir / f"{self.step():08d}-{time.strftime('%Y%m%dT%H%M%S')}"
        found = collect_stacks(self.processes(), out)
        (out / "what.txt").write_text(what + "\n")
        self.latest = out
        if self.status is not None:
            self.status.set_latest_hang(str(out))
        logger.warning("%s: the stacks of %d processes are in %s", what, len(found), out)
        return out, found

    def collect_safely(self, what: str) -> Path | None:
        """`collect`, where a failure to dump must not change what happens next (it is said instead)."""
        try:
            return self.collect(what)[0]
        except Exception as error:  # noqa: BLE001 - the dump must never hide or replace the failure itself
            logger.warning("%s: could not collect the processes' stacks: %s", what, error)
            return None

    def on_request(self) -> dict:
        """`rlsys stacks` / POST /api/v1/stacks on a live run: the same dump, returned whole."""
        out, found = self.collect("stacks on request (rlsys stacks, POST /api/v1/stacks)")
        return {"directory": str(out),
                "processes": [{**asdict(s), "summary": s.describe()} for s in found]}

    def on_trainer_hang(self, what: str, ranks: list[int]) -> str:
        """A trainer hang (RunEvents.trainer_hung): dump, then say where each rank is (the failure line's detail)."""
        try:
            out, found = self.collect(f"trainer rank(s) {', '.join(map(str, ranks))} did not finish {what}")
        except Exception as error:  # noqa: BLE001 - the dump must never hide the hang itself
            logger.warning("could not collect the processes' stacks: %s", error)
            return ""
        return f"{summarize(found)} (stacks of every process in {out})"
