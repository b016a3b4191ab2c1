"""multiprocessing's resource tracker, started with its output in the run's log.

The tracker is the process that removes what a process registered with it (the reward pool's
semaphores) once that process is gone. After a driver killed with SIGKILL it does that job and says
so on the stderr it was started with: "There appear to be 5 leaked semaphore objects to clean up at
shutdown" (or "No such file or directory", where the run's /dev/shm sweep removed the file first):
lines that reach the user's terminal after the run has ended, and read like a fault of its own.
Started here, before anything registers, its stderr is a file of the run directory: the clean-up
still happens and its record is kept, and the terminal shows only what rlsys says.
"""

from __future__ import annotations

import logging
import os
import sys
from multiprocessing import resource_tracker
from pathlib import Path

logger = logging.getLogger(__name__)


def start_resource_tracker(log_path: Path) -> bool:
    """Start this process's resource tracker with its stderr appended to `log_path`; False where one
    runs already (its output then stays where it was started)."""
    if getattr(resource_tracker._resource_tracker, "_fd", None) is not None:  # CPython's tracker: running
        logger.debug("multiprocessing's resource tracker was started before the run; its lines stay on stderr")
        return False
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    saved_stderr = os.dup(2)
    try:
        sys.stderr.flush()
        # The tracker inherits fd 2 as it is while it starts (ensure_running spawns it with the
        # parent's standard streams); this process's stderr is its own again right after.
        os.dup2(log_fd, 2)
        resource_tracker.ensure_running()
    finally:
        os.dup2(saved_stderr, 2)
        os.close(saved_stderr)
        os.close(log_fd)
    return True
