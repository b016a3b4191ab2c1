"""What rlsys says on the console: one logger tree ("rlsys", every module's `getLogger(__name__)`
under it), one format, and `configure_logging`, the one place that sets them up (the CLI calls it).

Lines read "rlsys: MESSAGE". INFO and DEBUG go to stdout, WARNING and above to stderr. A line
written while a tqdm progress bar is on the terminal goes through `tqdm.write`, which clears the
bar, writes the line and draws the bar again below it (a plain write would land in the bar's row).
"""

from __future__ import annotations

import logging
import sys

FORMAT = "rlsys: %(message)s"


class ConsoleHandler(logging.Handler):
    """stdout below WARNING, stderr from WARNING up. The streams are looked up for each record, so
    a replaced sys.stdout (pytest's capsys, contextlib.redirect_stdout) gets the lines."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            bars = _tqdm_with_open_bars()
            if bars is not None:
                bars.write(line, file=stream)
            else:
                stream.write(line + "\n")
            stream.flush()  # a line of a long run shows when it happens, also through a pipe
        except Exception:
            self.handleError(record)


def _tqdm_with_open_bars():
    """tqdm's class while one of its bars is open, else None (tqdm is not imported for that)."""
    module = sys.modules.get("tqdm.std")
    if module is None or not getattr(module.tqdm, "_instances", None):
        return None
    return module.tqdm


def configure_logging(level: int = logging.INFO) -> None:
    """Print the "rlsys" loggers' records at `level` and above (WARNING: --quiet, DEBUG: --verbose).
    Calling it again replaces the earlier set-up."""
    logger = logging.getLogger("rlsys")
    for handler in [h for h in logger.handlers if isinstance(h, ConsoleHandler)]:
        logger.removeHandler(handler)
    handler = ConsoleHandler()
    handler.setFormatter(logging.Formatter(FORMAT))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False  # a root handler (another library's basicConfig) would print each line twice
