"""When a process started, as a key that tells it from a later process given the same pid.

psutil's create_time() is boot time plus the start's clock ticks since boot, and the boot time the
kernel reports moves whenever the system clock is adjusted (NTP, a VM's clock): two readings of one
process's create_time() can differ by seconds. The ticks themselves (/proc/PID/stat's starttime,
Linux) never change for the process's life; elsewhere create_time() is what there is.
"""

from __future__ import annotations

import psutil


def start_ticks(pid: int) -> int | None:
    """The process's start in clock ticks since boot (/proc/PID/stat field 22); None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()  # after "pid (comm)": field 3 on
        return int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def start_key(process: psutil.Process) -> float:
    """A number that is the same for as long as `process` lives and differs for a later process with
    its pid: its start ticks, else (no /proc) psutil's create_time(). Raises psutil.Error if it is gone."""
    ticks = start_ticks(process.pid)
    return float(ticks) if ticks is not None else process.create_time()
