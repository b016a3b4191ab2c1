"""The driver's working directory, also after Ray has deleted it and made it again.

`ray job submit --working-dir` starts the driver inside the job's unpacked package. On a freshly
started cluster the first job's package directory is deleted and unpacked again at the same path
while the driver runs (Ray's runtime-env agent sets it up once more for the job's workers), so the
driver's working directory is an unlinked one: `os.getcwd()` raises FileNotFoundError, and so does
every `multiprocessing` "spawn" start, whose preparation data records the parent's os.getcwd()
(multiprocessing/spawn.py `get_preparation_data`). The path itself exists again; moving into it
is all that is needed.
"""

from __future__ import annotations

import logging
import os

from rlsys.errors import RunFailed

logger = logging.getLogger(__name__)

_DELETED = " (deleted)"  # what Linux appends to /proc/PID/cwd of an unlinked directory


def working_directory() -> str:
    """os.getcwd(); when this process's directory was deleted and made again at the same path, this
    process moves into the new one first. RunFailed when the path is gone for good."""
    try:
        return os.getcwd()
    except FileNotFoundError:
        path = os.readlink("/proc/self/cwd").removesuffix(_DELETED)
    if not os.path.isdir(path):
        raise RunFailed(f"this process's working directory {path} was deleted (under `ray job submit`, the job's "
                        "unpacked working_dir): start rlsys from a directory that stays") from None
    os.chdir(path)
    logger.debug("the working directory %s was deleted and made again (Ray's runtime env): moved into the new one",
                 path)
    return path
