"""`rlsys` command line: train, eval, plan, doctor, engines, export, serve, status, stacks, runs, compare,
make-tiny-model. `rlsys` and `python -m rlsys.cli` run `entry` (main.py); each command's handler and
parser are in run_commands.py or watch_commands.py."""

from rlsys.cli.main import build_parser, entry, main, parse_command_line
from rlsys.cli.run_commands import eval_table, train_overrides

__all__ = ["build_parser", "entry", "eval_table", "main", "parse_command_line", "train_overrides"]
