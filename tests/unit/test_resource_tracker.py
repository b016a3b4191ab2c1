"""A killed driver's resource tracker writes its clean-up lines into the run's log, not onto the
terminal (rlsys/system/resource_tracker.py)."""

import signal
import subprocess
import sys
import time

KILLED_AFTER_REGISTERING = """
import multiprocessing, os, signal, sys
from pathlib import Path
from rlsys.system.resource_tracker import start_resource_tracker
if sys.argv[1] != "-":
    assert start_resource_tracker(Path(sys.argv[1]))
lock = multiprocessing.get_context("spawn").Lock()  # a semaphore, registered with the tracker (as the reward pool's)
print("registered", flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # nothing unregisters it: the tracker removes it and says so
"""
LEAKED = "leaked semaphore objects to clean up at shutdown"


def _killed(log_arg: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-c", KILLED_AFTER_REGISTERING, log_arg], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == -signal.SIGKILL and "registered" in result.stdout, result.stderr
    return result


def test_a_killed_process_trackers_clean_up_lines_go_to_the_run_log_not_the_terminal(tmp_path):
    # Started as multiprocessing starts it, the tracker says so on the killed process's stderr (the
    # pipe stays open until the tracker is done, so the line is there when the run returns).
    assert LEAKED in _killed("-").stderr
    log = tmp_path / "logs" / "resource_tracker.log"
    assert "resource_tracker" not in _killed(str(log)).stderr
    deadline = time.monotonic() + 60  # the tracker cleans up once it sees the killed process's pipe close
    while not (log.exists() and LEAKED in log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert LEAKED in log.read_text()
