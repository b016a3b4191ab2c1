"""The model's answers, shown: a few of each step's samples and of each eval, with their prompt,
reward and finish reason (what TRL's log_completions, verl and slime show every step).

They go to RUN_DIR/samples.jsonl (one line per sample; `logging.samples_per_step` per step and
per eval set, each text cut to SHOWN_CHARS, so the file grows by a bounded amount a step), to the
status API (`GET /api/v1/samples`, the dashboard's table) and to the trackers as tables. A resumed
run drops the lines of the steps it runs again, as metrics.jsonl does.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

SHOWN_CHARS = 1000  # of a prompt or a response; a runaway generation can be very long
SHOWN_IN_STATUS = 40  # the latest rows the status API (and the dashboard's table) holds
COLUMNS = ("step", "source", "prompt", "response", "reward", "finish_reason", "response_tokens")


def _cut(text: str) -> str:
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + f"… ({len(text) - SHOWN_CHARS} more characters)"


SHOWN_IMAGES = 4  # thumbnails of a vision-language prompt's images a row holds


def shown_samples(step: int, source: str, prompts: Sequence[str], responses: Sequence[str],
                  rewards: Sequence[float | None], finish_reasons: Sequence[str], response_tokens: Sequence[int],
                  group_size: int, count: int, images: Sequence[tuple[bytes, ...]] | None = None) -> list[dict]:
    """The first answer of each of the first `count` prompts (groups of `group_size` answers each),
    as the rows samples.jsonl holds. `source`: "train", or "eval" / "eval:NAME" for an eval set.
    `images`: per sample, a vision-language prompt's; a row then holds thumbnails of them (data: URIs)."""
    from rlsys.multimodal.images import thumbnail_uri

    rows = []
    for index in range(0, min(len(prompts), count * group_size), group_size):
        row = {"step": step, "source": source, "prompt": _cut(prompts[index]), "response": _cut(responses[index]),
               "reward": rewards[index], "finish_reason": finish_reasons[index],
               "response_tokens": response_tokens[index]}
        if images is not None and images[index]:
            row["images"] = [thumbnail_uri(image) for image in images[index][:SHOWN_IMAGES]]
        rows.append(row)
    return rows


class SamplesLog:
    """RUN_DIR/samples.jsonl: appended to after each step, read back by the dashboard of a run that is over."""

    def __init__(self, path: Path):
        self.path = path

    def append(self, rows: list[dict]) -> None:
        if not rows:
            return
        with self.path.open("a") as log:
            log.write("".join(json.dumps(row) + "\n" for row in rows))

    def truncate_from(self, step: int) -> None:
        """Drop the lines of steps >= `step` (a resumed run runs them again)."""
        if not self.path.is_file():
            return
        kept = [line for line in self.path.read_text().splitlines(keepends=True) if _step_of(line) < step]
        temporary = self.path.with_suffix(".jsonl.tmp")
        temporary.write_text("".join(kept))
        temporary.replace(self.path)

    def holds_step(self, step: int) -> bool:
        """Whether the file has a line of `step`."""
        return self.path.is_file() and any(_step_of(line) == step for line in self.path.read_text().splitlines())

    def latest(self, limit: int) -> list[dict]:
        """The last `limit` rows (a cut-off last line, from a killed run, is passed over)."""
        if not self.path.is_file():
            return []
        rows = []
        for line in self.path.read_text().splitlines()[-limit:]:
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
        return rows


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62  # an unreadable line is dropped with the steps run again


def markdown_table(rows: list[dict]) -> str:
    """The rows as a Markdown table (TensorBoard's text panel renders it)."""
    def cell(value) -> str:
        return str(value).replace("|", "\\|").replace("\n", "⏎")

    header = "| " + " | ".join(COLUMNS[1:]) + " |\n|" + "---|" * (len(COLUMNS) - 1) + "\n"
    return header + "".join("| " + " | ".join(cell(row.get(c)) for c in COLUMNS[1:]) + " |\n" for row in rows)
