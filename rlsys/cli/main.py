"""`rlsys` command line: the parser of every command and `main`/`entry`, which run one."""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import sys

from rlsys.cli.common import add_verbosity
from rlsys.cli.run_commands import (
    add_doctor_command,
    add_engines_command,
    add_eval_command,
    add_export_command,
    add_make_tiny_model_command,
    add_plan_command,
    add_train_command,
)
from rlsys.cli.watch_commands import (
    add_compare_command,
    add_runs_command,
    add_serve_command,
    add_stacks_command,
    add_status_command,
)
from rlsys.errors import UserError
from rlsys.observability.logs import configure_logging

logger = logging.getLogger("rlsys.cli")  # not __name__: that is "__main__" under `python -m rlsys.cli`


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlsys", description="GRPO post-training on Ray + FSDP2 + SGLang")
    add_verbosity(parser, logging.INFO)
    commands = parser.add_subparsers(dest="command", required=True)
    add_train_command(commands)
    add_engines_command(commands)
    add_export_command(commands)
    add_serve_command(commands)
    add_status_command(commands)
    add_stacks_command(commands)
    add_runs_command(commands)
    add_compare_command(commands)
    add_eval_command(commands)
    add_plan_command(commands)
    add_doctor_command(commands)
    add_make_tiny_model_command(commands)
    for command in commands.choices.values():
        add_verbosity(command, argparse.SUPPRESS)
    return parser


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
