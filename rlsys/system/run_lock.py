"""One process per run directory: RUN_DIR/rlsys.lock holds the owner's pid, host and start time.

A lock left by a process that is gone (same host, pid not alive or now another program) is stale
and taken over; a live owner, or one on another host (its liveness cannot be checked from here),
refuses the start with a message naming it.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import psutil

from rlsys.config import ConfigError
from rlsys.errors import why_not_a_directory
from rlsys.system.process_start import start_ticks

LOCK_FILE = "rlsys.lock"


class RunDirInUse(ConfigError):
    """Another live process writes this run directory."""


def _owner_alive(owner: dict) -> bool:
    if owner.get("host") != socket.gethostname():
        return True  # cannot tell from here: assume it lives
    try:
        pid = int(owner["pid"])
        process = psutil.Process(pid)
        if owner.get("start_ticks") is not None and (ticks := start_ticks(pid)) is not None:
            return ticks == int(owner["start_ticks"])  # the same process, not one given its pid since
        # a recycled pid belongs to a process that started after the lock was written
        return process.create_time() <= float(owner.get("started_at", 0)) + 1.0
    except (psutil.Error, KeyError, ValueError, TypeError):
        return False


def read_owner(run_dir: Path) -> dict | None:
    """The lock's owner, or None when there is no lock (or it is unreadable)."""
    try:
        return json.loads((Path(run_dir) / LOCK_FILE).read_text())
    except (OSError, ValueError):
        return None


def owner_is_alive(run_dir: Path) -> bool:
    owner = read_owner(run_dir)
    return owner is not None and _owner_alive(owner)


class RunDirLock:
    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self._held = False

    def acquire(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ConfigError(f"run_dir {self.path.parent} cannot be used: "
                              f"{why_not_a_directory(self.path.parent, error)}; choose another run_dir") from None
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started_at": psutil.Process().create_time(),
              "start_ticks": start_ticks(os.getpid()), "locked_at": time.time()}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = read_owner(self.path.parent)
                if owner is not None and _owner_alive(owner):
                    raise RunDirInUse(
                        f"run directory {self.path.parent} is in use by pid {owner.get('pid')} on "
                        f"{owner.get('host')} (since {time.ctime(owner.get('locked_at', 0))}); stop that run first, "
                        f"or delete {self.path} if you are sure it is gone"
                    ) from None
                self.path.unlink(missing_ok=True)  # stale: its owner is gone
                continue
            with os.fdopen(fd, "w") as handle:
                json.dump(me, handle)
            self._held = True
            return
        raise RunDirInUse(f"could not take the lock {self.path}: another process keeps replacing it")

    def release(self) -> None:
        if self._held:
            owner = read_owner(self.path.parent)
            if owner is not None and owner.get("pid") == os.getpid():
                self.path.unlink(missing_ok=True)
            self._held = False
