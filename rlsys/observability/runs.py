"""Runs on disk, for `rlsys runs` (a table of runs) and `rlsys compare` (two runs' curves).

A run directory is one holding metrics.jsonl or status.json (what `rlsys train` writes). Nothing
here needs the run to be alive: everything is read from those two files.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from rlsys.errors import UsageError, why_not_a_directory
from rlsys.observability.metrics import read_metrics

logger = logging.getLogger(__name__)

DEFAULT_COMPARE_METRICS = ("reward_mean", "eval_reward_mean", "response_len_mean")


@dataclass(frozen=True)
class RunSummary:
    name: str
    path: Path
    state: str  # as status.json says (running, finished, stopped, failed), or "unknown"
    steps: int  # steps with a metrics row
    total_steps: int | None
    last_reward: float | None
    last_eval: float | None
    wall_s: float | None  # start to finish (or to the last step), every process of a resumed run together
    started_at: float | None  # when the run first started (a resumed run: its first process)

    @classmethod
    def read(cls, path: Path) -> RunSummary:
        status = _read_json(path / "status.json")
        rows = read_metrics(path / "metrics.jsonl") if (path / "metrics.jsonl").is_file() else []
        started = status.get("started_at")
        ended = status.get("finished_at") or (rows[-1].get("timestamp") if rows else None)
        return cls(
            name=path.name,
            path=path,
            state=status.get("state", "unknown"),
            steps=len(rows),
            total_steps=status.get("total_steps"),
            last_reward=_last(rows, "reward_mean"),
            last_eval=_last(rows, "eval_reward_mean"),
            wall_s=(status.get("earlier_s") or 0.0) + (ended - started) if started and ended else None,
            started_at=status.get("first_started_at") or started,
        )


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and ((path / "metrics.jsonl").is_file() or (path / "status.json").is_file())


def find_runs(root: Path) -> list[RunSummary]:
    """`root` itself if it is a run, else the runs directly under it, oldest first."""
    if not root.is_dir():
        raise FileNotFoundError(f"no directory {root}")
    paths = [root] if is_run_dir(root) else [p for p in sorted(root.iterdir()) if is_run_dir(p)]
    if paths != [root]:  # why a directory the user expected is missing from the table
        for other in sorted(p for p in root.iterdir() if p.is_dir() and p not in paths):
            logger.debug("%s is not a run directory (no metrics.jsonl or status.json); not listed", other)
    runs = [RunSummary.read(p) for p in paths]
    return sorted(runs, key=lambda r: (r.started_at is None, r.started_at or 0.0, r.name))


def runs_table(runs: list[RunSummary], title: str):
    from rich.table import Table

    table = Table(title=title)
    for column in ("run", "state", "steps", "last reward", "last eval", "wall time", "started"):
        table.add_column(column, justify="left" if column in ("run", "state", "started") else "right")
    for run in runs:
        steps = f"{run.steps}" + (f" / {run.total_steps}" if run.total_steps else "")
        table.add_row(run.name, run.state, steps, _fmt(run.last_reward), _fmt(run.last_eval),
                      _duration(run.wall_s), _when(run.started_at))
    return table


def compare_rows(runs: list[list[dict]], metrics: tuple[str, ...], max_rows: int = 25) -> list[int]:
    """The steps to show: those where any run evaluated (when eval is compared), else evenly spaced
    ones, at most `max_rows`, always with the first and the last step."""
    every = [row for rows in runs for row in rows]
    steps = sorted({r["step"] for r in every})
    if not steps:
        return []
    if any(m.startswith("eval_") for m in metrics):
        evaluated = sorted({r["step"] for r in every if r.get("eval_reward_mean") is not None})
        if evaluated:
            steps = evaluated
    stride = max(1, math.ceil(len(steps) / max_rows))
    return sorted(set(steps[::stride]) | {max(r["step"] for r in every)})


def run_letters(count: int) -> list[str]:
    """A, B, ... Z, then AA, AB, ...: how the tables name the runs compared."""
    letters = []
    for index in range(count):
        name, index = "", index + 1
        while index:
            index, rest = divmod(index - 1, 26)
            name = chr(ord("A") + rest) + name
        letters.append(name)
    return letters


def compare_table(runs: list[tuple[str, list[dict]]], metrics: tuple[str, ...]):
    """One row per chosen step, one column per metric holding every run's value ("A / B / ...").
    Steps are numbered as the console counts them (step N: the Nth step done; metrics.jsonl's
    `step` is N - 1)."""
    from rich.table import Table

    letters = run_letters(len(runs))
    by_step = [{r["step"]: r for r in rows} for _, rows in runs]
    table = Table(title=" vs ".join(f"{name} ({letter})" for (name, _), letter in zip(runs, letters, strict=True)))
    table.add_column("step", justify="right")
    for metric in metrics:
        table.add_column(f"{metric}\n{' / '.join(letters)}", justify="right", no_wrap=True)
    for step in compare_rows([rows for _, rows in runs], metrics):
        cells = [str(step + 1)]
        for metric in metrics:
            cells.append(" / ".join(_fmt(steps.get(step, {}).get(metric)) for steps in by_step))
        table.add_row(*cells)
    return table


def plot_compare(runs: list[tuple[str, list[dict]]], metrics: tuple[str, ...], out: Path) -> Path:
    """One panel per metric, every run's curve in each; written as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("rlsys compare --plot needs matplotlib: pip install 'rlsys[plot]'") from None
    figure, axes = plt.subplots(len(metrics), 1, figsize=(8, 2.6 * len(metrics)), squeeze=False)
    for axis, metric in zip(axes[:, 0], metrics, strict=True):
        for name, rows in runs:
            points = [(r["step"] + 1, r[metric]) for r in rows if isinstance(r.get(metric), (int, float))]
            if points:
                axis.plot(*zip(*points, strict=True), marker="o" if metric.startswith("eval_") else None,
                          markersize=3, label=name)
        axis.set_title(metric)
        axis.set_xlabel("step")
        axis.legend()
    figure.tight_layout()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(out, dpi=100)
    except OSError as error:  # a parent that is a file, no permission, a full disk
        raise UsageError(f"--plot {out}: cannot write the plot there ({why_not_a_directory(out.parent, error)})") from None
    finally:
        plt.close(figure)
    return out


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _last(rows: list[dict], key: str) -> float | None:
    for row in reversed(rows):
        if isinstance(row.get(key), (int, float)):
            return float(row[key])
    return None


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _when(timestamp: float | None) -> str:
    if timestamp is None:
        return "-"
    from datetime import datetime

    return datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M")
