"""A reaper: a small process that outlives its owner when the owner is killed without warning
(kill -9, OOM, its node's Ray ending the job) and cleans up after it on the owner's node.

While the owner lives it notes, every second, the processes the owner started. Once the owner is
gone it stops those that remain, removes the shared-memory files left on this node
(rlsys/system/shm_sweep.py) and, for the driver's reaper, marks a status that still says the run is
going as failed. After a clean exit it finds nothing to do.

- the driver's (started by `run`, with the run directory): the local Ray cluster, the actors and
  SGLang servers on the driver's node, the reward workers;
- every trainer rank's and engine's (started by the actor itself, on its node): /dev/shm is per
  node, so only a process there can remove what a killed rank (its staging buffer) or engine
  (SGLang's load slots) left, and an engine's SGLang server tree is stopped with it.

    python -m rlsys.system.reaper OWNER_PID [RUN_DIR]
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import psutil

from rlsys.system.interrupts import take_sigterm_again
from rlsys.system.process_start import start_key
from rlsys.system.shm_sweep import sweep_shared_memory

POLL_S = 1.0
GRACE_S = 5.0


def _descendants(driver: psutil.Process) -> dict[int, float]:
    """pid -> start key (rlsys/system/process_start.py) of everything the driver started (but this reaper)."""
    found = {}
    try:
        for child in driver.children(recursive=True):
            if child.pid != os.getpid():
                try:
                    found[child.pid] = start_key(child)
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
            if abs(start_key(process) - created) < 0.01 and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)  # the same process, not a recycled pid
        except psutil.Error:
            continue
    return alive


def _blocks_sigterm(process: psutil.Process) -> bool:
    """Whether SIGTERM is in the process's blocked mask (/proc/PID/status SigBlk)."""
    try:
        with open(f"/proc/{process.pid}/status") as status:
            for line in status:
                if line.startswith("SigBlk:"):
                    return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def stop_processes(noted: dict[int, float]) -> int:
    """SIGTERM, a grace period, then SIGKILL; returns how many had to be stopped. A process that
    blocks SIGTERM (the local Ray cluster's, the reward workers: rlsys.system.interrupts) gets SIGKILL at
    once: waiting out the grace period would also keep the multiprocessing resource tracker, whose
    pipe the reward workers hold open, from unlinking their semaphores before it is killed too."""
    remaining = _still_running(noted)
    for process in remaining:
        try:
            if _blocks_sigterm(process):
                process.kill()
            else:
                process.terminate()
        except psutil.Error:
            pass
    _, still = psutil.wait_procs(remaining, timeout=GRACE_S)
    kill_and_wait(still, GRACE_S)
    return len(remaining)


def kill_and_wait(processes: list[psutil.Process], timeout_s: float) -> None:
    """SIGKILL each (one already gone is skipped), then wait up to `timeout_s` for them to be gone."""
    for process in processes:
        try:
            process.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(processes, timeout=timeout_s)


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


def watch(owner_pid: int, run_dir: Path | None = None) -> None:
    try:
        owner = psutil.Process(owner_pid)
    except psutil.Error:
        return
    noted: dict[int, float] = {}
    while True:
        try:
            if not owner.is_running() or owner.status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.Error:
            break
        noted.update(_descendants(owner))
        time.sleep(POLL_S)
    if run_dir is not None:  # first: the status says so at once, not after the clean-up's grace periods
        mark_status_failed(run_dir, owner_pid)
    stop_processes(noted)
    time.sleep(0.5)  # let the kernel release the mappings of what was just stopped
    sweep_shared_memory()


def start_reaper(run_dir: Path | None = None):
    """Start a reaper for this process (its own session: a signal to this process's group spares
    it); with `run_dir`, the driver's, which also marks the run's status."""
    import subprocess

    return subprocess.Popen([sys.executable, "-m", "rlsys.system.reaper", str(os.getpid()),
                             *([str(run_dir)] if run_dir is not None else [])],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def start_actor_reaper() -> psutil.Process | None:
    """A reaper for this Ray actor's process (a trainer rank, an engine), detached from it; None
    outside an actor (an instance built in-process by a test or a bench).

    Detached (a double fork: its parent is init, not the actor) because Ray stops an actor's child
    processes when the actor's worker exits (Ray's kill_child_processes_on_worker_exit, the
    default), which is exactly when this reaper has its work to do."""
    import subprocess

    from rlsys.system.node import connected_ray

    ray = connected_ray()
    if ray is None or ray.get_runtime_context().get_actor_id() is None:
        return None
    launcher = subprocess.Popen([sys.executable, "-m", "rlsys.system.reaper", "--detach", str(os.getpid())],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                start_new_session=True, text=True)
    pid = launcher.stdout.readline().strip()
    launcher.wait()
    try:
        return psutil.Process(int(pid))
    except (ValueError, psutil.Error):
        return None  # it could not start: a killed actor then leaves its files to the next sweep


def stop_reaper(reaper: psutil.Process | None) -> None:
    """After a clean shutdown: nothing is left for the reaper to do."""
    if reaper is None:
        return
    try:
        reaper.terminate()  # psutil checks that the pid is still this process
    except psutil.Error:
        pass


def _detach_and_watch(owner_pid: int) -> None:
    """Fork; the parent prints the child's pid and exits, so the child (the reaper) is adopted by init."""
    child = os.fork()
    if child:
        print(child, flush=True)
        os._exit(0)
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    watch(owner_pid)


if __name__ == "__main__":
    # A trainer rank's or engine's reaper inherits SIGTERM blocked from the local Ray cluster
    # (rlsys.system.interrupts); `stop_reaper` stops it with SIGTERM. Its own session spares it group signals.
    take_sigterm_again()
    if sys.argv[1] == "--detach":
        _detach_and_watch(int(sys.argv[2]))
    else:
        watch(int(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else None)
