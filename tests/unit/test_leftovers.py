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
