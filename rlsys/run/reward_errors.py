"""What a failed reward call was, shown: once on the terminal (the run's first), and each step's
first in RUN_DIR/logs/reward_errors.jsonl, with its sample. reward_errors counts them all; without
this a value the run refused (1e300, NaN, a string) was a number in a column and nothing more."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from rlsys.algorithms.samples import ScoredBatch

logger = logging.getLogger(__name__)

# A response or prompt kept in the log is cut to this many characters (a runaway generation can be long).
SHOWN_CHARS = 2000


class RewardErrorLog:
    def __init__(self, run_dir: Path):
        self.path = run_dir / "logs" / "reward_errors.jsonl"
        self.said = False

    def note(self, step: int, scored: ScoredBatch) -> None:
        """After a round of rewards: its first failure, if any, written down (and said, the first time)."""
        if not scored.reward_errors:
            return
        sample = scored.first_error_sample or {}
        entry = {"step": step, "reward_errors": scored.reward_errors, "first_error": scored.first_error,
                 **{key: str(value)[:SHOWN_CHARS] for key, value in sample.items()}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as log:
            log.write(json.dumps(entry) + "\n")
        if not self.said:
            self.said = True
            # One line: a traceback's last line says what went wrong; the whole of it is in the file.
            lines = [line for line in str(scored.first_error).splitlines() if line.strip()]
            logger.warning("step %d: %d reward call(s) failed; the first, on prompt %r and response %r: %s (each "
                           "step's first, in full, is in %s; every one is counted in reward_errors; said once)",
                           step + 1, scored.reward_errors, entry.get("prompt", "")[:200],
                           entry.get("response", "")[:200], lines[-1] if lines else "?", self.path)
