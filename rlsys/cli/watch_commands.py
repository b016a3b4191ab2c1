"""The commands that look at runs: serve, status, stacks, runs, compare; each one's handler beside
its parser."""

from __future__ import annotations

import argparse
import logging
import os

from rlsys.errors import UsageError

logger = logging.getLogger("rlsys.cli")  # not __name__: one logger for every command's lines


def _serve(args: argparse.Namespace) -> int:
    import os
    import time

    from rlsys.observability.status.server import StatusServer
    from rlsys.observability.status.state import RunStatus

    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be a TCP port, 0-65535 (0 picks a free one), got {args.port}")
    try:
        status = RunStatus.from_run_dir(args.run_dir)
    except FileNotFoundError as error:
        logger.error("error: %s", error)
        return 2
    # A finished run takes no control calls; beyond loopback its reads need the token.
    token = os.environ.get("RLSYS_STATUS_TOKEN") or None
    server = StatusServer(status, args.host, args.port, token=token,
                          allow_unauthenticated_read=args.allow_unauthenticated_read, option_prefix="--")
    url = server.start()
    logger.info("serving %s (%s, %s steps) at %s/", args.run_dir, status.state, status.step, url)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.stop()
    return 0


def add_serve_command(commands) -> None:
    serve = commands.add_parser("serve", help="serve the dashboard and API over a finished run directory")
    serve.add_argument("run_dir")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8470)
    serve.add_argument("--allow-unauthenticated-read", action="store_true",
                       help="serve beyond loopback without a token ($RLSYS_STATUS_TOKEN)")
    serve.set_defaults(handler=_serve)


def _status(args: argparse.Namespace) -> int:
    import http.client
    import json
    import urllib.error
    import urllib.parse
    import urllib.request
    from datetime import datetime

    from rich.console import Console
    from rich.table import Table

    url = args.url.rstrip("/")
    parts = urllib.parse.urlsplit(url)
    try:
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in 0-65535
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"{args.url!r} is not the http:// URL of a status server, e.g. http://127.0.0.1:8470")
    try:
        with urllib.request.urlopen(f"{url}/api/v1/status", timeout=10) as response:
            status = json.loads(response.read())
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as error:
        logger.error("error: no rlsys status server at %s: %s", url, error)
        return 1
    table = Table(title=f"rlsys run {status['run_id']}", show_header=False)
    eta = status.get("eta_seconds")
    for key, value in [
        ("state", status["state"] + (" (pause requested)" if status.get("paused") else "")),
        ("step", f"{status['step']} / {status['total_steps']}"),
        ("weight version", status["weight_version"]),
        ("ETA", "-" if eta is None else f"{eta:.0f} s"),
        ("run dir", status["run_dir"]),
        ("data", _describe_dataset(status.get("dataset") or {})),
    ]:
        table.add_row(key, str(value))
    for key, value in (status.get("last_metrics") or {}).items():
        if key == "step":  # the step row above says it
            continue
        if key == "timestamp" and isinstance(value, (int, float)):
            key, value = "last step ended", datetime.fromtimestamp(value).strftime("%Y-%m-%d %H:%M:%S")
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else "-" if value is None else str(value))
    if status.get("error"):
        table.add_row("error", status["error"])
    Console().print(table)
    return 0


def _describe_dataset(dataset: dict) -> str:
    if not dataset:
        return "-"
    return (f"{dataset['train_prompts']} train / {dataset['eval_prompts']} eval prompts; "
            f"{dataset['skipped_rows']} rows skipped, {dataset['too_long_prompts']} prompts too long")


def add_status_command(commands) -> None:
    status = commands.add_parser("status", help="print a running (or served) run's status as a table")
    status.add_argument("url", nargs="?", default="http://127.0.0.1:8470")
    status.set_defaults(handler=_status)


def _stacks(args: argparse.Namespace) -> int:
    """`rlsys stacks RUN_DIR|URL`: every process's stacks of a live run, through its status API."""
    import json
    import urllib.error
    import urllib.request
    from pathlib import Path

    target = args.target
    if not target.startswith(("http://", "https://")):
        snapshot = Path(target) / "status.json"
        try:
            target = json.loads(snapshot.read_text()).get("status_url") or ""
        except (OSError, ValueError) as error:
            raise UsageError(f"{args.target} is neither a status server's http:// URL nor a run directory with a "
                             f"status.json: {error}") from None
        if not target:
            raise UsageError(f"{snapshot} names no status server (status.enabled was false?)")
    token = args.token or os.environ.get("RLSYS_STATUS_TOKEN")
    request = urllib.request.Request(f"{target.rstrip('/')}/api/v1/stacks", method="POST",
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as response:
            dump = json.loads(response.read())
    except urllib.error.HTTPError as error:
        detail = error.read().decode(errors="replace")[:500]
        hint = " (give the run's status.token: --token or RLSYS_STATUS_TOKEN)" if error.code == 401 else ""
        logger.error("error: %s refused: HTTP %d %s%s", target, error.code, detail, hint)
        return 1
    except (urllib.error.URLError, OSError, ValueError) as error:
        logger.error("error: no rlsys status server at %s: %s", target, error)
        return 1
    if args.json:
        print(json.dumps(dump))
        return 0
    for process in dump["processes"]:
        print(f"== {process['summary']}\n{process['stacks']}")
    print(f"rlsys stacks: {len(dump['processes'])} processes, also in {dump['directory']}")
    return 0


def add_stacks_command(commands) -> None:
    stacks = commands.add_parser("stacks", help="every process's Python stacks of a live run (driver, trainer ranks, "
                                 "engine servers), through its status API (needs status.token)")
    stacks.add_argument("target", metavar="RUN_DIR|URL", help="the run's directory (its status.json names the server) "
                        "or the status server's URL")
    stacks.add_argument("--token", help="the run's status.token (default: $RLSYS_STATUS_TOKEN)")
    stacks.add_argument("--json", action="store_true", help="one JSON object (directory, processes)")
    stacks.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the dump (default 120)")
    stacks.set_defaults(handler=_stacks)


def _runs(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rich.console import Console

    from rlsys.observability.runs import find_runs, runs_table

    root = Path(args.dir)
    try:
        runs = find_runs(root)
    except FileNotFoundError as error:
        logger.error("error: %s", error)
        return 2
    if not runs:
        logger.info("no runs under %s (a run directory holds metrics.jsonl or status.json)", root)
        return 0
    Console(width=max(Console().width, 110)).print(runs_table(runs, f"runs under {root}"))
    return 0


def add_runs_command(commands) -> None:
    runs = commands.add_parser("runs", help="a table of the runs under a directory (state, steps, last rewards)")
    runs.add_argument("dir", nargs="?", default="runs")
    runs.set_defaults(handler=_runs)


def _compare(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rich.console import Console

    from rlsys.observability.metrics import read_metrics
    from rlsys.observability.runs import compare_table, is_run_dir, plot_compare

    runs = [Path(run) for run in args.runs]
    if len(runs) < 2:
        raise UsageError("rlsys compare needs two runs or more")
    for run in runs:
        if not is_run_dir(run):
            logger.error("error: %s is not a run directory (no metrics.jsonl or status.json)", run)
            return 2
    rows = [read_metrics(run / "metrics.jsonl") if (run / "metrics.jsonl").is_file() else [] for run in runs]
    metrics = tuple(m.strip() for m in args.metrics.split(",") if m.strip())
    known = {key for run_rows in rows for row in run_rows for key in row}
    unknown = [m for m in metrics if m not in known]
    if unknown:
        logger.error("error: no run logged %s; some that they did: %s", ", ".join(unknown),
                     ", ".join(sorted(known)[:30]))
        return 2
    names = [run.name if [other.name for other in runs].count(run.name) == 1 else str(run) for run in runs]
    named = list(zip(names, rows, strict=True))
    Console(width=max(Console().width, 40 + (12 * len(runs)) * len(metrics))).print(compare_table(named, metrics))
    if args.plot:
        try:
            out = plot_compare(named, metrics, Path(args.plot))
        except RuntimeError as error:
            logger.error("error: %s", error)
            return 2
        logger.info("plot written to %s", out)
    return 0


def add_compare_command(commands) -> None:
    compare = commands.add_parser("compare", help="runs' metric curves side by side (and as a plot): two or more, "
                                  "e.g. a sweep's runs/lr-*")
    compare.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (two or more)")
    compare.add_argument("--metrics", default="reward_mean,eval_reward_mean,response_len_mean",
                         help="comma-separated metrics.jsonl keys (default: %(default)s)")
    compare.add_argument("--plot", metavar="PNG", default=None, help="also write the curves to this PNG file")
    compare.set_defaults(handler=_compare)
