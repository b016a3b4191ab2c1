"""`rlsys` command line: train, eval, plan, doctor, engines, export, serve, status, stacks, runs, compare,
make-tiny-model."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import sys

from rlsys.errors import UsageError, UserError
from rlsys.observability.logs import configure_logging

logger = logging.getLogger("rlsys.cli")  # not __name__: that is "__main__" under `python -m rlsys.cli`


def train_overrides(args: argparse.Namespace) -> list[str]:
    """The config overrides `rlsys train` applies: the command line's, then --resume's, then
    --quiet's (no progress bar: it is terminal output like the info lines it hides)."""
    return (list(args.overrides) + (["checkpoint.resume=auto"] if args.resume else [])
            + (["logging.progress_bar=false"] if args.log_level >= logging.WARNING else []))


def _train(args: argparse.Namespace) -> int:
    from rlsys.config import load_config
    from rlsys.errors import RunFailed
    from rlsys.run.lifecycle import StoppedAtOnce, run

    config = load_config(args.config, train_overrides(args))
    try:
        run(config)
    except RunFailed as error:
        logger.error("run failed: %s", error)
        return 1
    except StoppedAtOnce as stop:
        logger.error("%s", stop)
        return stop.code
    return 0


def _plan(args: argparse.Namespace) -> int:
    from rlsys.config import load_config
    from rlsys.plan.memory_plan import memory_plan, print_plan

    if args.gpus_per_node < 1:
        raise UsageError(f"--gpus-per-node must be >= 1 (got {args.gpus_per_node})")
    plan = memory_plan(load_config(args.config, list(args.overrides)), args.gpus_per_node)
    print_plan(plan, args.json)
    return 0 if plan.fits else 1


def _doctor(args: argparse.Namespace) -> int:
    """`rlsys doctor [CONFIG]` (rlsys/doctor/examine.py): 1 when a check found a blocker."""
    import json

    from rlsys.config import load_config
    from rlsys.doctor.examine import examine, print_report
    from rlsys.errors import RunFailed

    config = load_config(args.config, list(args.overrides)) if args.config else None
    if config is None and args.overrides:
        raise UsageError("overrides need a config: rlsys doctor CONFIG key=value ...")
    try:
        with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
            report = examine(config, args.address)
    except RunFailed as error:
        logger.error("doctor failed: %s", error)
        return 1
    if args.json:
        print(json.dumps(report.as_json(), default=str))
    else:
        print_report(report)
    return 1 if report.blockers else 0


def _eval(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from rlsys.config import load_config
    from rlsys.errors import RunFailed
    from rlsys.eval.evaluate import evaluate_model

    if not 0 <= args.show <= 64:
        raise UsageError(f"--show takes 0 to 64 answers per eval set, got {args.show}")
    config = load_config(args.config, [*args.overrides, f"logging.samples_per_step={args.show}"])
    shown: list[dict] = []
    try:
        # --json: stdout holds the one JSON object; the progress lines go to stderr meanwhile.
        with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext(), \
                _library_output_hidden(args.log_level):
            metrics = evaluate_model(config, checkpoint=Path(args.checkpoint) if args.checkpoint else None,
                                     model=Path(args.model) if args.model else None, shown=shown)
    except RunFailed as error:
        logger.error("eval failed: %s", error)
        return 1
    source = {"checkpoint": args.checkpoint} if args.checkpoint else {"model": args.model}
    if args.json:
        print(json.dumps({**source, "metrics": metrics, **({"samples": shown} if args.show else {})}))
        return 0
    from rich.console import Console

    table = eval_table(metrics, [s.name for s in config.eval.datasets], f"rlsys eval of {args.checkpoint or args.model}")
    # As wide as the table needs, not the 80 columns of a pipe or a small terminal (rich cuts headers)
    console = Console(width=max(Console().width, 24 + 14 * len(table.columns)))
    console.print(table)
    for sample in shown:
        reward = "error" if sample["reward"] is None else f"{sample['reward']:.4g}"
        console.print(f"[{sample['source']}] {sample['prompt']!r} -> {sample['response']!r} (reward {reward}, "
                      f"{sample['finish_reason']}, {sample['response_tokens']} tokens)", highlight=False, markup=False)
    return 0


def eval_table(metrics: dict, set_names: list[str], title: str):
    """`rlsys eval`'s table: one row per eval set (the data section's eval prompts first), one
    column per metric; what "at max_new_tokens" counts said under it (not an error by itself)."""
    from rich.table import Table

    from rlsys.run.evaluation import metrics_by_set

    per_set = metrics_by_set(metrics, set_names)
    columns = list(dict.fromkeys(column for values in per_set.values() for column in values))
    # pass@k by k (the sets' metrics arrive in the order their sampling finished), where pass@ first stood
    by_k = iter(sorted((c for c in columns if c.startswith("pass_at_")), key=lambda c: int(c.rsplit("_", 1)[1])))
    columns = [next(by_k) if column.startswith("pass_at_") else column for column in columns]
    table = Table(title=title, caption="at max_new_tokens: the share of answers that reached the length limit "
                  "without EOS or a stop string (expected when answers are meant to be that long)")
    table.add_column("eval set")
    short = {"reward_mean": "reward", "reward_errors": "errors", "response_len_mean": "length",
             "truncated_fraction": "at max_new_tokens"}
    for column in columns:
        table.add_column(short.get(column, column.replace("pass_at_", "pass@")), justify="right")
    for name, values in per_set.items():
        if values:
            cells = (f"{values[c]:.4g}" if isinstance(values.get(c), float) else str(values.get(c, "-")) for c in columns)
            table.add_row(name or "(data)", *cells)
    return table


def _engines(args: argparse.Namespace) -> int:
    """`rlsys engines up|status|down` (rlsys/engines/standing_set.py)."""
    import json
    from pathlib import Path

    from rlsys.engines import standing_set
    from rlsys.rollout.standing import StandingEnginesError

    try:
        if args.action == "up":
            from rlsys.config import load_config

            config = load_config(args.config, list(args.overrides))
            log_dir = Path(args.log_dir) if args.log_dir else Path("runs") / "engines" / args.name
            record = standing_set.engines_up(config, args.name, log_dir, args.address,
                                                 warm_trainers=args.warm_trainers)
            logger.info("standing engines %r serve %s; attach a run with rollout.attach=%s (`rlsys engines down "
                        "--name %s` stops them)", record.name, record.model_path, record.name, record.name)
        elif args.action == "status":
            reports = standing_set.engines_status(args.address)
            if args.json:
                print(json.dumps(reports, indent=2, default=str))
            else:
                print(standing_set.status_table(reports))
        else:
            standing_set.engines_down(None if args.all else args.name, args.force, args.address)
    except StandingEnginesError as error:
        logger.error("error: %s", error)
        return 1
    return 0


@contextlib.contextmanager
def _library_output_hidden(log_level: int):
    """For a command whose output is its result (`export`, `eval`, `make-tiny-model`): transformers' and
    huggingface_hub's progress bars, transformers' logger below errors and Python's warnings off,
    unless -v asks for everything."""
    if log_level <= logging.DEBUG:
        yield
        return
    import warnings

    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    disable_progress_bars()
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # its logger's warnings too, not only Python's warnings
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        transformers_logging.set_verbosity(verbosity)
        transformers_logging.enable_progress_bar()
        enable_progress_bars()


def _export(args: argparse.Namespace) -> int:
    from rlsys.tools.export import export_hf

    with _library_output_hidden(args.log_level):
        out = export_hf(args.run_dir, args.step, args.out_dir, merged=args.merged, overwrite=args.overwrite)
    logger.info("Hugging Face checkpoint written to %s", out)
    return 0


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


def _describe_dataset(dataset: dict) -> str:
    if not dataset:
        return "-"
    return (f"{dataset['train_prompts']} train / {dataset['eval_prompts']} eval prompts; "
            f"{dataset['skipped_rows']} rows skipped, {dataset['too_long_prompts']} prompts too long")


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


def _make_tiny_model(args: argparse.Namespace) -> int:
    from rlsys.tools.tiny_model import TinyModelSpec, make_tiny_model

    spec = TinyModelSpec(hidden_size=args.hidden_size, num_layers=args.num_layers, seed=args.seed, arch=args.arch,
                         init_std=args.init_std)
    with _library_output_hidden(args.log_level):  # transformers' "Writing model shards" bar
        out = make_tiny_model(args.out_dir, spec, chat=args.chat)
    logger.info("tiny model written to %s", out)
    return 0


def _add_verbosity(parser: argparse.ArgumentParser, default) -> None:
    """-q/--quiet and -v/--verbose, before the command or after it (`rlsys -q train ...` or
    `rlsys train ... -q`); a command's parser leaves the value alone when neither follows it."""
    levels = parser.add_mutually_exclusive_group()
    levels.add_argument("-q", "--quiet", dest="log_level", action="store_const", const=logging.WARNING,
                        default=default, help="print only warnings and errors")
    levels.add_argument("-v", "--verbose", dest="log_level", action="store_const", const=logging.DEBUG,
                        default=default, help="also print debug lines (e.g. each step's phase timings)")


DEFAULT_ENGINES_NAME = "default"


def _standing_name(value: str) -> str:
    import re

    from rlsys.config import STANDING_NAME_PATTERN

    if not re.match(STANDING_NAME_PATTERN, value):
        raise argparse.ArgumentTypeError(f"{value!r}: letters, digits, '_', '.', '-' (beginning with a letter or digit)")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlsys", description="GRPO post-training on Ray + FSDP2 + SGLang")
    _add_verbosity(parser, logging.INFO)
    commands = parser.add_subparsers(dest="command", required=True)
    _add_train_command(commands)
    _add_engines_command(commands)
    _add_export_command(commands)
    _add_serve_command(commands)
    _add_status_command(commands)
    _add_stacks_command(commands)
    _add_runs_command(commands)
    _add_compare_command(commands)
    _add_eval_command(commands)
    _add_plan_command(commands)
    _add_doctor_command(commands)
    _add_make_tiny_model_command(commands)
    for command in commands.choices.values():
        _add_verbosity(command, argparse.SUPPRESS)
    return parser


def _add_train_command(commands) -> None:
    train = commands.add_parser("train", help="run a GRPO job from a YAML config")
    train.add_argument("config", help="YAML config, e.g. configs/quickstart.yaml")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-5")
    train.add_argument("--resume", action="store_true",
                       help="continue from the latest checkpoint in run_dir (same as checkpoint.resume=auto)")
    train.set_defaults(handler=_train)


def _add_engines_command(commands) -> None:
    engines = commands.add_parser("engines", help="standing SGLang engines that outlive a run: up, status, down "
                                  "(a run uses them with rollout.attach=NAME)")
    actions = engines.add_subparsers(dest="action", required=True)
    up = actions.add_parser("up", help="start a config's engines (placed as its run would place them) and leave "
                            "them running")
    up.add_argument("config", help="the YAML config of the runs that will attach")
    up.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.num_engines=2")
    up.add_argument("--no-warm-trainers", dest="warm_trainers", action="store_false",
                    help="keep no trainer ranks between the runs that attach (by default the set keeps the last "
                    "run's, released, and the next run's model is built in them: no rank start-up)")
    down = actions.add_parser("down", help="stop standing engines (their servers, /dev/shm files, placement)")
    down.add_argument("--all", action="store_true", help="every standing set of the cluster")
    down.add_argument("--force", action="store_true", help="even while a run holds their lease")
    engines_status = actions.add_parser("status", help="the standing sets: engines, health, lease")
    engines_status.add_argument("--json", action="store_true", help="one JSON document instead of a table")
    for action in (up, down, engines_status):
        action.add_argument("--address", default=None, help="Ray cluster (default: placement.ray_address, "
                            "RAY_ADDRESS, or the cluster `rlsys engines up` started on this machine)")
    for action in (up, down):
        action.add_argument("--name", default=DEFAULT_ENGINES_NAME, type=_standing_name,
                            help="the set's name (default: %(default)s)")
    up.add_argument("--log-dir", default=None, help="the engines' logs (default: runs/engines/NAME; on a cluster, "
                    "storage every node sees)")
    engines.set_defaults(handler=_engines)
    for action in actions.choices.values():
        _add_verbosity(action, argparse.SUPPRESS)


def _add_export_command(commands) -> None:
    export = commands.add_parser("export", help="write a run's checkpoint as a Hugging Face model")
    export.add_argument("run_dir")
    export.add_argument("out_dir")
    export.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    export.add_argument("--merged", action="store_true",
                        help="a LoRA run: the base model with the adapters merged in (default: the PEFT adapter)")
    export.add_argument("--overwrite", action="store_true",
                        help="replace what OUT_DIR holds (default: a directory with files in it is refused)")
    export.set_defaults(handler=_export)


def _add_serve_command(commands) -> None:
    serve = commands.add_parser("serve", help="serve the dashboard and API over a finished run directory")
    serve.add_argument("run_dir")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8470)
    serve.add_argument("--allow-unauthenticated-read", action="store_true",
                       help="serve beyond loopback without a token ($RLSYS_STATUS_TOKEN)")
    serve.set_defaults(handler=_serve)


def _add_status_command(commands) -> None:
    status = commands.add_parser("status", help="print a running (or served) run's status as a table")
    status.add_argument("url", nargs="?", default="http://127.0.0.1:8470")
    status.set_defaults(handler=_status)


def _add_stacks_command(commands) -> None:
    stacks = commands.add_parser("stacks", help="every process's Python stacks of a live run (driver, trainer ranks, "
                                 "engine servers), through its status API (needs status.token)")
    stacks.add_argument("target", metavar="RUN_DIR|URL", help="the run's directory (its status.json names the server) "
                        "or the status server's URL")
    stacks.add_argument("--token", help="the run's status.token (default: $RLSYS_STATUS_TOKEN)")
    stacks.add_argument("--json", action="store_true", help="one JSON object (directory, processes)")
    stacks.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the dump (default 120)")
    stacks.set_defaults(handler=_stacks)


def _add_runs_command(commands) -> None:
    runs = commands.add_parser("runs", help="a table of the runs under a directory (state, steps, last rewards)")
    runs.add_argument("dir", nargs="?", default="runs")
    runs.set_defaults(handler=_runs)


def _add_compare_command(commands) -> None:
    compare = commands.add_parser("compare", help="runs' metric curves side by side (and as a plot): two or more, "
                                  "e.g. a sweep's runs/lr-*")
    compare.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (two or more)")
    compare.add_argument("--metrics", default="reward_mean,eval_reward_mean,response_len_mean",
                         help="comma-separated metrics.jsonl keys (default: %(default)s)")
    compare.add_argument("--plot", metavar="PNG", default=None, help="also write the curves to this PNG file")
    compare.set_defaults(handler=_compare)


def _add_eval_command(commands) -> None:
    evaluate = commands.add_parser("eval", help="run a config's eval sets against a checkpoint or a model, "
                                   "on real engines (no trainer)")
    evaluate.add_argument("config", help="YAML config whose eval sets (data's eval prompts, eval.datasets) to run")
    evaluate.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.num_engines=2")
    source = evaluate.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", metavar="DIR", help="a run's checkpoint: RUN_DIR/checkpoints/step_N")
    source.add_argument("--model", metavar="HF_DIR", help="a Hugging Face model directory (e.g. from rlsys export)")
    evaluate.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    evaluate.add_argument("--show", type=int, default=0, metavar="N",
                          help="also print N answers of each eval set: prompt, response, reward, finish reason")
    evaluate.set_defaults(handler=_eval)


def _add_plan_command(commands) -> None:
    plan = commands.add_parser("plan", help="print the memory each GPU will hold, per phase, and whether it fits; "
                               "and the host memory per trainer rank and per node")
    plan.add_argument("config", help="YAML config, e.g. configs/gpu_colocated.yaml")
    plan.add_argument("overrides", nargs="*", help="dotted overrides, e.g. placement.gpu_memory_gb=80")
    plan.add_argument("--json", action="store_true", help="one JSON object (fits, per_gpu_bytes, terms, host_terms, "
                      "host_per_node_bytes, ...)")
    plan.add_argument("--gpus-per-node", type=int, default=8, metavar="N",
                      help="GPUs of a node, for the host memory per node (default 8)")
    plan.set_defaults(handler=_plan)


def _add_doctor_command(commands) -> None:
    doctor = commands.add_parser("doctor", help="check the nodes a config's run would use before a job: resources, "
                                 "/dev/shm, GPUs, versions, run_dir and model, ports, clocks, a collective test")
    doctor.add_argument("config", nargs="?", help="YAML config (without one: every node of the cluster, without the "
                        "run's own checks)")
    doctor.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.num_ranks=4")
    doctor.add_argument("--address", metavar="RAY_ADDRESS", help="the Ray cluster to check (default: "
                        "placement.ray_address, RAY_ADDRESS, else a local cluster on this machine)")
    doctor.add_argument("--json", action="store_true", help="one JSON object (ok, nodes, collectives, problems, env)")
    doctor.set_defaults(handler=_doctor)


def _add_make_tiny_model_command(commands) -> None:
    tiny = commands.add_parser(
        "make-tiny-model", help="build a local random-init model + tokenizer",
        description="Write a random-init causal LM (fp32, safetensors, config.json, generation_config.json) and "
                    "a character-level tokenizer (one token per character; tokenizer.json and tokenizer_config.json, "
                    "also alone in OUT_DIR/tokenizer/) to OUT_DIR, for runs without a model hub. Configs on it set "
                    "rollout.engine.skip_tokenizer_init: true, as configs/quickstart.yaml does (the engine takes and "
                    "returns token ids; rlsys tokenizes). Defaults: 133,696 parameters (qwen2, 2 layers, 64 wide).")
    tiny.add_argument("out_dir", help="the directory to write (created if missing; its files of these names are "
                                      "replaced)")
    tiny.add_argument("--hidden-size", type=int, default=64)
    tiny.add_argument("--num-layers", type=int, default=2)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--init-std", type=float, default=0.02,
                      help="std of the random weights (0.1: a base a LoRA run can learn on, docs/operations.md)")
    tiny.add_argument("--arch", default="qwen2", help="qwen2 (default), qwen3, llama, qwen3_moe, or qwen2_5_vl (a "
                      "vision-language model: a 2-block vision tower, and Qwen2.5-VL's processor saved beside it with "
                      "the vision markers in the tokenizer and a chat template that renders images)")
    tiny.add_argument("--chat", action="store_true", help="a tokenizer with a Qwen-style chat template")
    tiny.set_defaults(handler=_make_tiny_model)


def parse_command_line(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed command line. Dotted overrides may also come after a command's flags
    (`rlsys train CONFIG --resume trainer.total_steps=100`): argparse ends a `nargs="*"`
    positional at the first flag, so what follows the flags is taken as more overrides when the
    command has them and none of it is a flag."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and isinstance(getattr(args, "overrides", None), list) and not any(e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_command_line(argv)
    configure_logging(args.log_level)
    try:
        return args.handler(args)
    except UserError as error:  # your input is wrong: one clear message, no traceback
        logger.error("error: %s", error)
        return 2


def entry() -> None:
    """The `rlsys` command and `python -m rlsys.cli`: `main`, then the process ends without the
    interpreter's module-by-module teardown. When `main` returns, everything a run started is
    stopped and its files are written and closed; what the teardown would still do is take torch,
    transformers and Ray's core worker apart object by object, 1.5 s at the end of every
    `rlsys train` here. The atexit handlers still run (logging's flush among them). An exception
    out of `main` takes the ordinary way out, with its traceback."""
    code = main()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
