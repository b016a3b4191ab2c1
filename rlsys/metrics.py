"""metrics.jsonl: one JSON object per step, appended and flushed as each step ends."""

from __future__ import annotations

import json
import math
from pathlib import Path


class MetricsLog:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.rows: list[dict] = read_metrics(self.path) if self.path.exists() else []

    def append(self, row: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        self.rows.append(clean)
        with self.path.open("a") as handle:
            handle.write(json.dumps(clean) + "\n")
            handle.flush()


    def truncate_from(self, step: int) -> None:
        """Drop rows of steps >= `step` (they are about to run again after a resume)."""
        if not self.path.exists():
            return
        kept = [row for row in read_metrics(self.path) if row.get("step", 0) < step]
        temporary = self.path.with_suffix(".jsonl.tmp")
        temporary.write_text("".join(json.dumps(row) + "\n" for row in kept))
        temporary.replace(self.path)
        self.rows = kept


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
