"""The run's reaper: a small process that outlives a driver killed without warning (kill -9, OOM)
and cleans up after it.

While the driver lives it notes, every second, the processes the driver started (the local Ray
cluster, its actors and their SGLang servers, reward workers). Once the driver is gone it stops
those that remain, removes the shared-memory files they left (rlsys/shm_sweep.py) and marks a
status that still says the run is going as failed. After a clean exit it finds nothing to do.

    python -m rlsys.reaper DRIVER_PID RUN_DIR
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import psutil

from rlsys.shm_sweep import sweep_shared_memory

POLL_S = 1.0
GRACE_S = 5.0


def _descendants(driver: psutil.Process) -> dict[int, float]:
    """pid -> create time of everything the driver started (but this reaper)."""
    found = {}
    try:
        for child in driver.children(recursive=True):
            if child.pid != os.getpid():
                try:
                    found[child.pid] = child.create_time()
                except psutil.Error:
                    continue
    except psutil.Error:
        pass
    return found


def _still_running(noted: dict[int, float]) -> list[psutil.Process]:
    alive = []
    for pid, created in noted.items():
        try:
            process = psutil.Process(pid)
            if abs(process.create_time() - created) < 0.01 and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)  # the same process, not a recycled pid
        except psutil.Error:
            continue
    return alive


def stop_processes(noted: dict[int, float]) -> int:
    """SIGTERM, a grace period, then SIGKILL; returns how many had to be stopped."""
    remaining = _still_running(noted)
    for process in remaining:
        try:
            process.terminate()
        except psutil.Error:
            pass
    _, still = psutil.wait_procs(remaining, timeout=GRACE_S)
    for process in still:
        try:
            process.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(still, timeout=GRACE_S)
    return len(remaining)


def mark_status_failed(run_dir: Path, driver_pid: int) -> None:
    path = run_dir / "status.json"
    try:
        status = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if status.get("state") in ("finished", "stopped", "failed"):
        return
    status.update(state="failed", finished_at=time.time(), eta_seconds=None,
                  error=f"the driver (pid {driver_pid}) died without finishing (killed?)")
    temporary = path.with_suffix(".json.reaper")
    temporary.write_text(json.dumps(status))
    os.replace(temporary, path)


def watch(driver_pid: int, run_dir: Path) -> None:
    try:
        driver = psutil.Process(driver_pid)
    except psutil.Error:
        return
    noted: dict[int, float] = {}
    while True:
        try:
            if not driver.is_running() or driver.status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.Error:
            break
        noted.update(_descendants(driver))
        time.sleep(POLL_S)
    stop_processes(noted)
    time.sleep(0.5)  # let the kernel release the mappings of what was just stopped
    sweep_shared_memory()
    mark_status_failed(run_dir, driver_pid)


def start_reaper(run_dir: Path):
    """Start this run's reaper (its own session: a signal to the driver's group spares it)."""
    import subprocess

    return subprocess.Popen([sys.executable, "-m", "rlsys.reaper", str(os.getpid()), str(run_dir)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


if __name__ == "__main__":
    watch(int(sys.argv[1]), Path(sys.argv[2]))
