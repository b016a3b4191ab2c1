"""What a run killed without warning leaves behind is recognised and removed at the next start,
and a run directory has one owner at a time."""

import json
import os
import socket
import subprocess
import sys

import pytest

from rlsys.system.run_lock import RunDirInUse, RunDirLock, owner_is_alive
from rlsys.system.shm_sweep import creator_pid, sweep_shared_memory


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_stale_shared_memory_files_are_removed_and_live_ones_kept(tmp_path):
    dead, me = _dead_pid(), os.getpid()
    for name in (f"torch_{dead}_123_0", f"torch_{me}_456_0", f"sgl_shm_sched_{dead}_ab12cd34",
                 "sglang_loads_engine_0a1b2c3d.shm", "sglang_loads_held_ffff0000.shm", "unrelated_file"):
        (tmp_path / name).write_bytes(b"x")
    with open(tmp_path / "sglang_loads_held_ffff0000.shm", "rb"):  # someone still has it open
        removed = sweep_shared_memory(tmp_path)
    assert sorted(removed) == sorted([f"torch_{dead}_123_0", f"sgl_shm_sched_{dead}_ab12cd34",
                                      "sglang_loads_engine_0a1b2c3d.shm"])
    assert sorted(os.listdir(tmp_path)) == sorted([f"torch_{me}_456_0", "sglang_loads_held_ffff0000.shm",
                                                   "unrelated_file"])


def test_creator_pids_are_read_from_the_names_that_carry_them():
    assert creator_pid("torch_9263_4120554082_0") == 9263
    assert creator_pid("sgl_shm_multi_word_kind_77_deadbeef") == 77
    assert creator_pid("sglang_loads_x.shm") is None and creator_pid("torch_notapid_1") is None


def test_a_run_directory_has_one_live_owner(tmp_path):
    lock = RunDirLock(tmp_path)
    lock.acquire()
    assert owner_is_alive(tmp_path)
    with pytest.raises(RunDirInUse, match=f"in use by pid {os.getpid()} on {socket.gethostname()}"):
        RunDirLock(tmp_path).acquire()
    lock.release()
    assert not (tmp_path / "rlsys.lock").exists() and not owner_is_alive(tmp_path)


def test_a_lock_whose_owner_died_is_taken_over(tmp_path):
    (tmp_path / "rlsys.lock").write_text(json.dumps({"pid": _dead_pid(), "host": socket.gethostname(),
                                                     "started_at": 0, "locked_at": 0}))
    assert not owner_is_alive(tmp_path)
    lock = RunDirLock(tmp_path)
    lock.acquire()
    assert json.loads((tmp_path / "rlsys.lock").read_text())["pid"] == os.getpid()
    lock.release()


def test_the_owner_is_the_process_that_started_when_the_lock_says_whatever_the_clock_did_since(tmp_path, monkeypatch):
    """Liveness is the pid's start in ticks since boot, which no clock adjustment moves: a live owner
    whose start time in epoch seconds has drifted (psutil adds the boot time the kernel reports now)
    still owns the directory, and a process that was given the pid later does not."""
    import psutil

    from rlsys.system.process_start import start_ticks

    lock = RunDirLock(tmp_path)
    lock.acquire()
    owner = json.loads((tmp_path / "rlsys.lock").read_text())
    assert owner["start_ticks"] == start_ticks(os.getpid()) is not None
    real_create_time = psutil.Process.create_time
    monkeypatch.setattr(psutil.Process, "create_time", lambda self: real_create_time(self) + 5.0)  # clock stepped
    assert owner_is_alive(tmp_path)
    with pytest.raises(RunDirInUse):
        RunDirLock(tmp_path).acquire()
    (tmp_path / "rlsys.lock").write_text(json.dumps({**owner, "start_ticks": owner["start_ticks"] - 1}))
    assert not owner_is_alive(tmp_path)  # the pid now belongs to a process that started at another tick
    lock.release()


def test_a_lock_held_from_another_host_is_respected(tmp_path):
    (tmp_path / "rlsys.lock").write_text(json.dumps({"pid": 1, "host": "another-node", "started_at": 0,
                                                     "locked_at": 0}))
    with pytest.raises(RunDirInUse, match="in use by pid 1 on another-node"):
        RunDirLock(tmp_path).acquire()


def test_the_local_clusters_processes_are_waited_for_after_its_shutdown_and_stragglers_killed(monkeypatch):
    """ray.kill only asks an actor to exit: a worker that is slow to go (a loaded machine, a rank in
    the middle of an I/O) must not outlive the driver."""
    import time

    import psutil

    from rlsys.system import cluster

    monkeypatch.setattr(cluster, "WORKER_EXIT_GRACE_S", 1.5)
    slow = psutil.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    stuck = psutil.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    started = time.monotonic()
    cluster._wait_for_exit([slow, stuck])
    assert slow.returncode == 0  # exited on its own, waited for
    assert stuck.returncode == -9  # outlived the grace period: killed
    assert time.monotonic() - started < 10


def test_the_reaper_still_knows_the_processes_it_noted_after_the_clock_moved(monkeypatch):
    """A child noted while the owner lived is stopped after the owner is gone even if the system clock
    was adjusted meanwhile (its create_time() then reads seconds off); a pid reused since is not."""
    import psutil

    from rlsys.system import reaper

    child = psutil.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        noted = reaper._descendants(psutil.Process())
        assert child.pid in noted
        real_create_time = psutil.Process.create_time
        monkeypatch.setattr(psutil.Process, "create_time", lambda self: real_create_time(self) + 5.0)
        assert [p.pid for p in reaper._still_running({child.pid: noted[child.pid]})] == [child.pid]
        assert reaper._still_running({child.pid: noted[child.pid] - 1}) == []  # another process with that pid
    finally:
        child.kill()
        child.wait()
