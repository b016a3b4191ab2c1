"""Errors that end a run with a message for the user (the CLI prints them without a traceback)."""

from __future__ import annotations

from pathlib import Path


class RunFailed(RuntimeError):
    """The run stopped on bad input or a broken component; the message says which."""


class UsageError(ValueError):
    """A command's argument or input file the user can fix (a bad path, number or URL); the CLI prints
    it as `rlsys: error: ...` and exits with 2."""


def disk_full_failure(error: BaseException, run_dir: Path) -> RunFailed | None:
    """A RunFailed naming the full file system, its free space and the checkpoint a resume starts
    from, when `error` comes from a disk with no space left (directly, from an actor or in its
    chain of causes); None otherwise."""
    import errno
    import shutil

    from rlsys.checkpointing import CheckpointStore

    found, pending, seen = None, [error], set()
    while pending and found is None:
        error = pending.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            found = error
        # Ray's wrapper of an actor's exception keeps it in `cause`; DCP's CheckpointException keeps
        # each rank's (exception, traceback) in `failures`
        failures = getattr(error, "failures", None)
        pending += [getattr(error, "cause", None), error.__cause__, error.__context__]
        pending += [pair[0] for pair in failures.values()] if isinstance(failures, dict) else []
    if found is None:
        return None
    writing = f" (writing {found.filename})" if found.filename else ""
    usage = shutil.disk_usage(run_dir)  # after the writers removed their partial files
    latest = CheckpointStore(run_dir).latest()
    then = f"then --resume continues from {latest}" if latest else "no checkpoint was written yet"
    return RunFailed(f"no space left on the device of {run_dir}{writing}: {usage.free / 2**20:.1f} MiB free of "
                     f"{usage.total / 2**20:.1f} MiB there; free some space, {then}")


def why_not_a_directory(path, error: OSError) -> str:
    """Why `path` could not be made a directory (`error` from its mkdir), for the message: the
    file in the way, if any, else the system's reason."""
    from pathlib import Path

    path = Path(path)
    blocking = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    return f"{blocking} is a file, not a directory" if blocking is not None else str(error.strerror)
