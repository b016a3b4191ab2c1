"""Errors that end a run with a message for the user (the CLI prints them without a traceback)."""

from __future__ import annotations

from pathlib import Path


class RunFailed(RuntimeError):
    """The run stopped on bad input or a broken component; the message says which."""


class UsageError(ValueError):
    """A command's argument or input file the user can fix (a bad path, number or URL); the CLI prints
    it as `rlsys: error: ...` and exits with 2."""


def why_not_a_directory(path, error: OSError) -> str:
    """Why `path` could not be made a directory (`error` from its mkdir), for the message: the
    file in the way, if any, else the system's reason."""

    path = Path(path)
    blocking = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    return f"{blocking} is a file, not a directory" if blocking is not None else str(error.strerror)
