"""Shared-memory files that runs killed without warning leave in /dev/shm, and their removal.

- `torch_<pid>_...` (torch's file_system sharing: trainer staging buffers) and
  `sgl_shm_<kind>_<pid>_...` name their creator: stale once it is gone.
- `sglang_loads_...` (SGLang's load slots) name none: stale when no process maps or opens them.
Live files of other runs are never touched: their creators live, or someone holds them.
"""

from __future__ import annotations

import os
from pathlib import Path

SHM_DIR = Path("/dev/shm")
_UNOWNED_PREFIXES = ("sglang_loads_",)


def creator_pid(name: str) -> int | None:
    parts = name.split("_")
    try:
        if name.startswith("torch_") and len(parts) >= 3:
            return int(parts[1])
        if name.startswith("sgl_shm_") and len(parts) >= 5:
            return int(parts[-2])
    except ValueError:
        return None
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process


def holders(shm_dir: Path = SHM_DIR) -> dict[str, set[int]]:
    """Each path in `shm_dir` that a process we may inspect maps or has open, with those processes'
    pids. Processes we may not inspect (init, other users') are skipped: they do not hold a run's
    load slots."""
    prefix = f"{shm_dir}/"
    held: dict[str, set[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid, paths = int(entry.name), set()
        try:  # what is found is kept even when the process exits (or an fd closes) midway
            paths.update(line.split(maxsplit=5)[5].strip() for line in (entry / "maps").read_text().splitlines()
                         if line.count(" ") >= 5 and prefix in line)
            for fd in (entry / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith(prefix):
                    paths.add(target)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            pass  # exited meanwhile, or not ours to inspect
        for path in paths:
            held.setdefault(path.removesuffix(" (deleted)"), set()).add(pid)
    return held


def sweep_shared_memory(shm_dir: Path = SHM_DIR) -> list[str]:
    """Remove stale files (rules in the module docstring); returns their names."""
    try:
        names = sorted(os.listdir(shm_dir))
    except OSError:
        return []
    removed, held = [], None
    for name in names:
        pid = creator_pid(name)
        if pid is not None:
            stale = not _alive(pid)
        elif name.startswith(_UNOWNED_PREFIXES):
            held = holders(shm_dir) if held is None else held
            stale = str(shm_dir / name) not in held
        else:
            continue
        if stale:
            try:
                os.unlink(shm_dir / name)
                removed.append(name)
            except OSError:
                pass
    return removed
