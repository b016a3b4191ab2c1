"""Stopping a run from a terminal or a job runner: Ctrl-C (SIGINT to the whole foreground process
group) and SIGTERM (to the driver, or to its whole process group as Kubernetes, SLURM's scancel,
`timeout` and most job runners send it) stop after the current step, with a checkpoint; a second
one stops at once. The processes a group signal also reaches (the local Ray cluster's, the reward
workers) never receive it, or the run could not finish its step: checked here on short stand-in
processes (the end-to-end cases: tests/e2e/test_stop_signals.py and tests/e2e/test_faults.py)."""

import json
import os
import signal
import subprocess
import sys
import threading

import pytest

from rlsys.observability.status.state import RunStatus
from rlsys.rollout.sglang.server import _die_with_parent
from rlsys.run.lifecycle import StoppedAtOnce, _stop_on_signals
from rlsys.system.interrupts import children_in_process_groups_of_their_own, children_shielded_from_stop_signals
from tests.helpers import REPO

REPORT_BLOCKED = "import signal; print(sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])))"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _blocked_in_child(**popen) -> set[int]:
    answer = subprocess.run([sys.executable, "-c", REPORT_BLOCKED], capture_output=True, text=True, check=True,
                            **popen)
    return set(json.loads(answer.stdout)) & set(STOP_SIGNALS)


def _blocked_here() -> set[int]:
    return signal.pthread_sigmask(signal.SIG_BLOCK, []) & set(STOP_SIGNALS)


def test_processes_started_in_the_block_never_get_ctrl_c_or_sigterm_and_the_mask_comes_back():
    assert not _blocked_here()
    with children_shielded_from_stop_signals():
        assert _blocked_in_child() == set(STOP_SIGNALS)
    assert not _blocked_here()
    assert not _blocked_in_child()


@pytest.mark.parametrize("signum", STOP_SIGNALS)
def test_a_child_that_installs_its_own_handler_still_does_not_get_the_signal(signum):
    """Ray's runtime-env agent and autoscaler monitor install SIGINT handlers, GCS and raylet SIGTERM
    ones, and exit on them."""
    child_code = (f"import signal, sys, time; signal.signal({int(signum)}, lambda *a: sys.exit(3)); "
                  "print('ready', flush=True); time.sleep(2)")
    with children_shielded_from_stop_signals():
        child = subprocess.Popen([sys.executable, "-c", child_code], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    child.send_signal(signum)
    assert child.wait(timeout=30) == 0  # slept its 2 s to the end


@pytest.mark.parametrize("signum", STOP_SIGNALS)
def test_ray_daemons_lead_process_groups_no_group_signal_reaches_yet_their_own_sigterm_ends_them(signum):
    """How the local Ray cluster starts (rlsys.system.cluster): GCS and raylet install SIGTERM handlers and
    exit on them, so the driver's group signal must not reach them; ray.shutdown's own SIGTERM must
    (it waits 1 s per process that ignores it before SIGKILL)."""
    child_code = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(3)); "
                  "signal.signal(signal.SIGINT, lambda *a: sys.exit(4)); print('ready', flush=True); time.sleep(600)")
    # the test's own process group, so that the group signal below reaches nothing else
    group_leader = subprocess.Popen([sys.executable, "-c", (
        "import signal, subprocess, sys, time\n"
        "from rlsys.system.interrupts import children_in_process_groups_of_their_own\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN); signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "with children_in_process_groups_of_their_own():\n"
        f"    child = subprocess.Popen([sys.executable, '-c', {child_code!r}], stdout=subprocess.PIPE, text=True)\n"
        "assert child.stdout.readline().strip() == 'ready'\n"
        "import os; print(os.getpgid(child.pid) == child.pid != os.getpgid(0), flush=True)\n"
        f"os.killpg(0, {int(signum)}); time.sleep(1)\n"
        "print(child.poll(), flush=True)\n"
        "child.terminate(); print(child.wait(timeout=60), flush=True)\n")],
        stdout=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True)
    out, _ = group_leader.communicate(timeout=120)
    assert group_leader.returncode == 0
    assert out.split() == ["True", "None", "3"]  # its own group; untouched by the group signal; SIGTERM ends it
    with children_in_process_groups_of_their_own():
        pass
    assert subprocess.Popen.__init__.__qualname__ == "Popen.__init__"  # the patch is gone after the block


def test_it_works_from_any_thread_and_leaves_that_threads_mask_as_it_was():
    seen = []

    def start_child():
        with children_shielded_from_stop_signals():
            seen.append(_blocked_in_child())
        seen.append(_blocked_here())

    thread = threading.Thread(target=start_child)
    thread.start()
    thread.join()
    assert seen == [set(STOP_SIGNALS), set()]


def test_spawned_multiprocessing_workers_never_get_them_even_the_first():
    """The reward workers: the first spawn starts multiprocessing's resource tracker, which on
    CPython 3.11 unblocks both signals in the starting thread. A fresh interpreter, whose tracker
    is not running yet."""
    code = ("import multiprocessing, signal\n"
            "from concurrent.futures import ProcessPoolExecutor\n"
            "from rlsys.system.interrupts import (children_in_process_groups_of_their_own,\n"
            "                                     children_shielded_from_stop_signals)\n"
            "if __name__ == '__main__':\n"
            "    with children_shielded_from_stop_signals():\n"
            "        pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context('spawn'))\n"
            "        blocked = pool.submit(signal.pthread_sigmask, signal.SIG_BLOCK, [])\n"
            "    print(sorted(int(s) for s in blocked.result()))\n"
            "    pool.shutdown()\n")
    answer = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert set(json.loads(answer.stdout)) >= set(STOP_SIGNALS)


def test_an_sglang_server_started_by_a_shielded_engine_actor_still_stops_on_sigterm():
    """The engine actor inherits the mask from the raylet; its server, in its own session, is
    stopped with SIGTERM (SGLangServer.stop, and PR_SET_PDEATHSIG when the actor dies)."""
    with children_shielded_from_stop_signals():
        assert _blocked_in_child(preexec_fn=_die_with_parent) == {signal.SIGINT}


def test_a_reaper_started_by_a_shielded_actor_still_stops_on_sigterm():
    """`stop_reaper` ends a trainer rank's or engine's reaper with SIGTERM after a clean shutdown;
    one that blocked it would live on until its owner exits."""
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        with children_shielded_from_stop_signals():
            reaper = subprocess.Popen([sys.executable, "-m", "rlsys.system.reaper", str(owner.pid)], cwd=REPO)
        reaper.terminate()  # pending while still blocked: delivered once the reaper unblocks it
        assert reaper.wait(timeout=60) == -signal.SIGTERM
    finally:
        owner.kill()
        owner.wait()


TRACKER = ("import os, signal, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); os.close(int(sys.argv[2])); "
           "print('ready', flush=True); os.read(int(sys.argv[1]), 1); open(sys.argv[3], 'w').write('cleaned up')")


def test_the_reaper_kills_shielded_processes_at_once_so_the_resource_tracker_can_clean_up(tmp_path):
    """After a driver's kill -9: multiprocessing's resource tracker ignores SIGTERM and unlinks the
    reward workers' semaphores once the last of them, which hold its pipe open, is gone. A worker
    that blocks SIGTERM, left to the end of the grace period, would be killed with the tracker."""
    from rlsys.system.process_start import start_key
    from rlsys.system.reaper import stop_processes

    read_end, write_end = os.pipe()
    cleaned = tmp_path / "cleaned"
    tracker = subprocess.Popen([sys.executable, "-c", TRACKER, str(read_end), str(write_end), str(cleaned)],
                               pass_fds=(read_end, write_end), stdout=subprocess.PIPE, text=True)
    with children_shielded_from_stop_signals():
        worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], pass_fds=(write_end,))
    os.close(read_end)
    os.close(write_end)
    assert tracker.stdout.readline().strip() == "ready"
    import psutil

    # the tracker first: were both stopped alike, it would get its SIGKILL while the worker lived
    noted = {process.pid: start_key(psutil.Process(process.pid)) for process in (tracker, worker)}
    assert stop_processes(noted) == 2
    assert not psutil.pid_exists(worker.pid) and not psutil.pid_exists(tracker.pid)  # reaped by stop_processes
    assert cleaned.read_text() == "cleaned up"


@pytest.fixture()
def restored_handlers():
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    yield
    for signum, handler in handlers.items():
        signal.signal(signum, handler)


@pytest.mark.parametrize(("first", "second"), [(signal.SIGINT, signal.SIGINT), (signal.SIGTERM, signal.SIGINT),
                                               (signal.SIGINT, signal.SIGTERM)])
def test_the_first_signal_requests_a_stop_and_the_second_stops_at_once(restored_handlers, capsys, first, second):
    status = RunStatus(run_id="r", total_steps=10, run_dir="/tmp/r")
    _stop_on_signals(status)
    signal.raise_signal(first)
    assert status.stop_requested
    assert "stopping after this step, with a checkpoint" in capsys.readouterr().out
    with pytest.raises(StoppedAtOnce) as stopped:
        signal.raise_signal(second)
    assert stopped.value.code == 128 + second  # 130 after a Ctrl-C, as a shell reports it
    assert "without a checkpoint" in str(stopped.value)
