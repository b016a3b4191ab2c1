"""metrics.jsonl: one JSON object per step, appended and flushed as each step ends."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

from rlsys.errors import UserError

logger = logging.getLogger(__name__)


class MetricsLog:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.rows: list[dict] = read_metrics(self.path) if self.path.exists() else []

    def append(self, row: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        line = memoryview((json.dumps(clean) + "\n").encode())
        with self.path.open("ab", buffering=0) as handle:  # unbuffered: a failed write is not retried on close
            end = handle.seek(0, os.SEEK_END)
            try:
                while line:
                    line = line[handle.write(line):]
            except OSError:
                handle.truncate(end)  # a full disk: no torn line left behind, and its space back
                raise
        self.rows.append(clean)


    def truncate_from(self, step: int) -> None:
        """Drop rows of steps >= `step` (they are about to run again after a resume)."""
        if not self.path.exists():
            return
        kept = [row for row in self.rows if row.get("step", 0) < step]  # the file's rows, read once
        temporary = self.path.with_suffix(".jsonl.tmp")
        try:
            temporary.write_text("".join(json.dumps(row) + "\n" for row in kept))
        except OSError:
            temporary.unlink(missing_ok=True)
            raise
        temporary.replace(self.path)
        self.rows = kept


class MetricsFileError(UserError):
    """A metrics.jsonl line that is not a JSON object (other than a torn last line)."""


def read_metrics(path: Path) -> list[dict]:
    """The rows of a metrics.jsonl. Its last line, when a kill or a full disk cut the append short
    (no newline at its end and not valid JSON), is dropped with a warning on stderr (a resume then
    cuts the file at its checkpoint, as always). Any other line that is not a JSON object raises
    MetricsFileError naming `file:line`."""
    path = Path(path)
    lines = path.read_bytes().split(b"\n")  # appends end with "\n": a last piece without one is torn
    rows = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except ValueError as error:  # JSONDecodeError and UnicodeDecodeError
            if number == len(lines):
                logger.warning("warning: %s:%d: the last line is cut off (an append interrupted by a kill or a "
                               "full disk); it is dropped", path, number)
                continue
            raise MetricsFileError(f"{path}:{number}: not a JSON object ({error}); fix or delete that line") from None
        if not isinstance(row, dict):
            raise MetricsFileError(f"{path}:{number}: not a JSON object (a {type(row).__name__}); "
                                   "fix or delete that line")
        rows.append(row)
    return rows
