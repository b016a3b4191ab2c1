"""What the commands share: -q/-v, the standing set names, library output kept quiet."""

from __future__ import annotations

import argparse
import contextlib
import logging


def add_verbosity(parser: argparse.ArgumentParser, default) -> None:
    """-q/--quiet and -v/--verbose, before the command or after it (`rlsys -q train ...` or
    `rlsys train ... -q`); a command's parser leaves the value alone when neither follows it."""
    levels = parser.add_mutually_exclusive_group()
    levels.add_argument("-q", "--quiet", dest="log_level", action="store_const", const=logging.WARNING,
                        default=default, help="print only warnings and errors")
    levels.add_argument("-v", "--verbose", dest="log_level", action="store_const", const=logging.DEBUG,
                        default=default, help="also print debug lines (e.g. each step's phase timings)")


DEFAULT_ENGINES_NAME = "default"


def standing_name(value: str) -> str:
    import re

    from rlsys.config import STANDING_NAME_PATTERN

    if not re.match(STANDING_NAME_PATTERN, value):
        raise argparse.ArgumentTypeError(f"{value!r}: letters, digits, '_', '.', '-' (beginning with a letter or digit)")
    return value


@contextlib.contextmanager
def library_output_hidden(log_level: int):
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
