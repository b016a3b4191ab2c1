"""Stopping a run from a terminal: Ctrl-C (SIGINT to the whole foreground process group) and
SIGTERM both stop after the current step, with a checkpoint; a second one stops at once. The
processes a Ctrl-C also reaches (the local Ray cluster's, the reward workers) never receive it, or the
run could not finish its step (the end-to-end case: tests/test_faults.py)."""

import signal
import subprocess
import sys
import threading

import pytest

from rlsys.coordinator import StoppedAtOnce, _stop_on_signals
from rlsys.interrupts import children_shielded_from_ctrl_c
from rlsys.status.state import RunStatus

REPORT_SIGINT_BLOCKED = "import signal; print(signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))"


def _child_blocks_sigint() -> bool:
    answer = subprocess.run([sys.executable, "-c", REPORT_SIGINT_BLOCKED], capture_output=True, text=True, check=True)
    return answer.stdout.strip() == "True"


def _blocked_here() -> bool:
    return signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])


def test_processes_started_in_the_block_never_get_ctrl_c_and_the_mask_comes_back():
    assert not _blocked_here()
    with children_shielded_from_ctrl_c():
        assert _child_blocks_sigint()
    assert not _blocked_here()
    assert not _child_blocks_sigint()


def test_a_child_that_installs_its_own_handler_still_does_not_get_ctrl_c():
    """Ray's runtime-env agent and autoscaler monitor install SIGINT handlers and exit on it."""
    child_code = ("import signal, sys, time; signal.signal(signal.SIGINT, lambda *a: sys.exit(3)); "
                  "print('ready', flush=True); time.sleep(2)")
    with children_shielded_from_ctrl_c():
        child = subprocess.Popen([sys.executable, "-c", child_code], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    child.send_signal(signal.SIGINT)
    assert child.wait(timeout=30) == 0  # slept its 2 s to the end


def test_it_works_from_any_thread_and_leaves_that_threads_mask_as_it_was():
    seen = []

    def start_child():
        with children_shielded_from_ctrl_c():
            seen.append(_child_blocks_sigint())
        seen.append(_blocked_here())

    thread = threading.Thread(target=start_child)
    thread.start()
    thread.join()
    assert seen == [True, False]


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
