"""Errors that end a run with a message for the user (the CLI prints them without a traceback)."""

from __future__ import annotations

from pathlib import Path


class RlsysError(Exception):
    """The root of the errors rlsys explains in one line: the CLI prints them without a traceback.
    Two kinds below it: the user's input is wrong (UserError), or the run stopped (RunFailed)."""


class UserError(RlsysError, ValueError):
    """Input the user can fix (a config value, a data row, a user function, a path); the CLI prints
    it as `rlsys: error: ...` and exits with 2. Subclasses name what kind of input."""


class RunFailed(RlsysError, RuntimeError):
    """The run stopped on bad input or a broken component; the message says which (exit 1)."""


class UsageError(UserError):
    """A command's argument or input file the user can fix (a bad path, number or URL)."""


def why_not_a_directory(path, error: OSError) -> str:
    """Why `path` could not be made a directory (`error` from its mkdir), for the message: the
    file in the way, if any, else the system's reason."""

    path = Path(path)
    blocking = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    return f"{blocking} is a file, not a directory" if blocking is not None else str(error.strerror)
