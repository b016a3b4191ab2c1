"""The end-to-end tests' leftovers check (tests/helpers.Leftovers) reports what the test itself left,
alive, orphaned or dead, and never a process of someone else's on the machine nor its files: the
fault tests kill the processes it names, and another pytest or a developer's own run may be there."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import LEFTOVERS_MARK, SESSION_MARK

SHM = Path("/dev/shm")
SLEEP = "import time; time.sleep(60)"
# Starts argv[1:] and prints its pid, without waiting: the started process is then init's.
START = ("import subprocess, sys; "
         "print(subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)")
# A parent that starts an unmarked sleeper named argv[1] and lives on, as a raylet with its agents.
PARENT = (f"import os, subprocess, sys, time; env = {{k: v for k, v in os.environ.items() if k != {LEFTOVERS_MARK!r}}}; "
          f"subprocess.Popen([sys.executable, '-c', {SLEEP!r}, sys.argv[1]], env=env); time.sleep(60)")


@pytest.fixture
def processes():
    """Processes a test starts, killed at its end."""
    started: list[psutil.Process] = []
    yield started
    for process in started:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def _env(mark: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != LEFTOVERS_MARK}
    return {**env, LEFTOVERS_MARK: mark} if mark else env


def _outside(argv: list[str], mark: str | None, processes: list) -> psutil.Process:
    """`argv` started outside this pytest's tree, as a run's processes are once the run is over,
    with `mark` (None: unmarked) in its environment."""
    starter = subprocess.run([sys.executable, "-c", START, *argv], env=_env(mark), capture_output=True, text=True,
                             check=True)
    process = psutil.Process(int(starter.stdout))
    processes.append(process)
    return process


def _sleeper(name: str, mark: str | None, processes: list) -> psutil.Process:
    return _outside([sys.executable, "-c", SLEEP, name], mark, processes)


def _unmarked_child_of(parent_mark: str | None, name: str, processes: list) -> psutil.Process:
    parent = _outside([sys.executable, "-c", PARENT, name], parent_mark, processes)
    deadline = time.monotonic() + 30
    while not (children := parent.children()):
        assert time.monotonic() < deadline, "the parent started no child"
        time.sleep(0.05)
    processes.append(children[0])
    return children[0]


def _pids(lines: list[str]) -> set[int]:
    return {int(line.split(":")[0]) for line in lines}


def test_the_tests_own_processes_are_reported_and_killable_and_no_one_elses(leftovers, processes):
    ours = _sleeper("sglang-stand-in", leftovers.mark, processes)
    another_tests = _sleeper("sglang-stand-in", "another-test", processes)
    developers = _unmarked_child_of(None, "sglang-stand-in", processes)  # under a run started by hand
    found = _pids(leftovers.processes())
    assert ours.pid in found and another_tests.pid not in found and developers.pid not in found
    assert [p.pid for p in leftovers.new_pids("sglang-stand-in")] == [ours.pid]


def test_unmarked_processes_count_under_the_tests_parent_or_orphaned(leftovers, processes):
    """Ray starts its agents with an environment of their own (no mark)."""
    under_the_tests = _unmarked_child_of(leftovers.mark, "ray::Agent-stand-in", processes)
    orphaned = _sleeper("ray::Agent-stand-in", None, processes)
    assert orphaned.ppid() == 1, "an orphan is adopted by init on these machines"
    under_someone_elses = _unmarked_child_of(None, "ray::Agent-stand-in", processes)
    found = _pids(leftovers.processes())
    assert under_the_tests.pid in found and orphaned.pid in found and under_someone_elses.pid not in found
    named = [p.pid for p in leftovers.new_pids("ray::Agent-stand-in")]  # to be killed: marked ones only
    assert under_the_tests.pid not in named and orphaned.pid not in named


def test_an_orphan_of_another_pytest_session_is_not_the_tests(leftovers, processes, monkeypatch):
    """make test runs pytest sessions side by side, and a multi-node test daemonizes its Ray nodes:
    init's children, unmarked by any test, but marked by the session that started them."""
    monkeypatch.setenv(SESSION_MARK, "this-session")
    ours = _sleeper("raylet-stand-in", None, processes)
    monkeypatch.setenv(SESSION_MARK, "another-session")
    another_sessions = _sleeper("raylet-stand-in", None, processes)
    monkeypatch.setenv(SESSION_MARK, "this-session")
    assert ours.ppid() == another_sessions.ppid() == 1
    found = _pids(leftovers.processes())
    assert ours.pid in found and another_sessions.pid not in found


def test_files_of_dead_or_own_creators_count_and_live_foreign_ones_do_not(leftovers, processes):
    ours = _sleeper("creator", leftovers.mark, processes)
    someone_elses = _unmarked_child_of(None, "creator", processes)
    # A creator that is gone: a pid no process can have (one that ended may be reused meanwhile, as pids wrap
    # at pid_max: 32768 on these machines, which a loaded CI machine goes round in minutes)
    dead = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1
    held = SHM / "sem.mp-rlsys-test-held"
    names = [f"torch_{ours.pid}_1_0", f"torch_{someone_elses.pid}_2_0", f"torch_{dead}_3_0", held.name,
             "sem.mp-rlsys-test-unheld"]
    try:
        for name in names:
            (SHM / name).write_bytes(b"x")
        holder = _outside([sys.executable, "-c", f"import time; f = open({str(held)!r}, 'rb'); time.sleep(60)"],
                          "another-test", processes)
        deadline = time.monotonic() + 30
        while not any(f.path == str(held) for f in holder.open_files()):
            assert time.monotonic() < deadline, "the holder did not open its file"
            time.sleep(0.05)
        # A run of the other stream sweeps /dev/shm as it starts and ends (rlsys/system/shm_sweep.py) and
        # removes the files of dead creators, ours among them, perhaps between the check's two scans: the
        # check is read only from a scan after which every file still stood (a sweep's removal is no verdict)
        for _ in range(10):
            mine = [name for name in leftovers.shm_files() if name in names]  # the other stream makes its own
            if all((SHM / name).exists() for name in names):
                break
            for name in names:
                (SHM / name).write_bytes(b"x")
        else:
            raise AssertionError("/dev/shm was swept under every one of 10 checks")
        assert mine == sorted([f"torch_{ours.pid}_1_0", f"torch_{dead}_3_0", "sem.mp-rlsys-test-unheld"])
    finally:
        for name in names:
            (SHM / name).unlink(missing_ok=True)


def test_a_file_unlinked_within_the_settle_time_is_not_a_leftover(leftovers):
    """A semaphore another session's process releases (its resource tracker unlinks it a moment later)
    shows up unowned in one scan; only a file still there after SHM_SETTLE_S is reported."""
    from tests.helpers import SHM_SETTLE_S

    passing, staying = SHM / "sem.mp-rlsys-test-passing", SHM / "sem.mp-rlsys-test-staying"
    try:
        passing.write_bytes(b"x")
        staying.write_bytes(b"x")
        threading.Timer(SHM_SETTLE_S / 4, passing.unlink).start()
        mine = [name for name in leftovers.shm_files() if name in (passing.name, staying.name)]
        assert mine == [staying.name]
    finally:
        passing.unlink(missing_ok=True)
        staying.unlink(missing_ok=True)
