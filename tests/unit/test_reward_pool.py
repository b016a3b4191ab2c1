"""Reward calls in worker processes: a reward that raises, returns a non-number, hangs or kills its
worker gives a counted error outcome, the other calls keep their values, and the pool recovers."""

import time

import pytest

from rlsys.errors import RunFailed
from rlsys.records import RewardCall
from rlsys.rewards.pool import RewardPool, score_calls

REWARDS = '''
import os, time

def by_label(prompt, response, label, metadata):
    if label == "raise":
        raise KeyError("boom")
    if label == "string":
        return "1.0"
    if label == "nan":
        return float("nan")
    if label == "hang":
        time.sleep(60)
    if label == "die":
        os._exit(3)
    return float(response == label)
'''


def _wait_until_dead(workers, timeout_s: float = 30.0) -> None:
    """Until each killed worker is a zombie (or gone), without reaping it: psutil.wait_procs would reap
    the pool's children behind multiprocessing's back, whose Popen then never learns the exit code, and
    the executor's manager thread spun on is_alive() forever (a hang at the end of the test session)."""
    import psutil

    deadline = time.monotonic() + timeout_s
    for worker in workers:
        while time.monotonic() < deadline:
            try:
                if worker.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.02)


def _calls(*labels: str) -> list[RewardCall]:
    return [RewardCall(prompt="p", response="7", label=label, metadata={}) for label in labels]


@pytest.fixture()
def pool(tmp_path, monkeypatch):
    (tmp_path / "user_rewards.py").write_text(REWARDS)
    monkeypatch.chdir(tmp_path)  # a reward module named by path, beside the run's working directory
    pool = RewardPool("user_rewards.py:by_label", num_workers=2, timeout_s=1.0)
    yield pool
    pool.close()


def test_values_come_back_in_order_and_failures_are_explained(pool):
    outcomes = pool.score(_calls("7", "raise", "string", "8", "nan", "7"))
    assert [o.value for o in outcomes] == [1.0, None, None, 0.0, None, 1.0]
    assert "KeyError" in outcomes[1].error
    assert "'1.0'" in outcomes[2].error and "finite number" in outcomes[2].error
    assert "nan" in outcomes[4].error


def test_a_hanging_reward_is_stopped_at_its_timeout_and_the_rest_still_score(pool):
    start = time.monotonic()
    outcomes = pool.score(_calls("7", "hang", "8", "7"))
    assert time.monotonic() - start < 20  # not the 60 s the call wanted
    assert [o.value for o in outcomes] == [1.0, None, 0.0, 1.0]
    assert "longer than 1s (reward.timeout_s)" in outcomes[1].error


@pytest.mark.parametrize("num_workers", [1, 2])
def test_a_call_that_ends_its_worker_fails_only_its_sample_and_is_said_once(tmp_path, monkeypatch, capsys,
                                                                             num_workers):
    """Like a NaN reward: one counted error; the other calls of the step, and every later step, score."""
    (tmp_path / "user_rewards.py").write_text(REWARDS)
    monkeypatch.chdir(tmp_path)
    pool = RewardPool("user_rewards.py:by_label", num_workers=num_workers, timeout_s=5.0)
    try:
        for _step in range(2):
            outcomes = pool.score(_calls("7", "8", "die", "7", "8", "7"))
            assert [o.value for o in outcomes] == [1.0, 0.0, None, 1.0, 0.0, 1.0]
            assert "ended its worker process (exit code 3)" in outcomes[2].error
    finally:
        pool.close()
    said = [line for line in capsys.readouterr().err.splitlines() if "ended its reward worker" in line]  # a warning
    assert said == ["rlsys: a reward call ended its reward worker process (exit code 3); the call counts as a "
                    "reward error of its sample and the reward workers were restarted (said once; later ones are "
                    "counted in reward_errors)"]


def test_the_exit_code_of_a_worker_the_executor_already_forgot_is_still_read(tmp_path, monkeypatch):
    """ProcessPoolExecutor's manager thread drops a worker it has seen die from its process table,
    sometimes before the pool reads the exit code (CI saw "an unknown exit" once, on a loaded
    machine). Here the table is emptied just before, every time: the code still comes through."""
    (tmp_path / "user_rewards.py").write_text(REWARDS)
    monkeypatch.chdir(tmp_path)
    pool = RewardPool("user_rewards.py:by_label", num_workers=1, timeout_s=5.0)
    replace = pool._replace_pool

    def after_the_manager_thread_forgot():
        # A new empty table rather than clearing the one the manager thread iterates (that raced
        # it: "dictionary changed size during iteration" in the thread); the pool reads the new one.
        if pool._executor is not None and pool._executor._processes:
            pool._executor._processes = {}
        return replace()

    monkeypatch.setattr(pool, "_replace_pool", after_the_manager_thread_forgot)
    try:
        outcomes = pool.score(_calls("7", "die", "8"))
        assert [o.value for o in outcomes] == [1.0, None, 0.0]
        assert "ended its worker process (exit code 3)" in outcomes[1].error
    finally:
        pool.close()


def test_workers_killed_between_steps_are_replaced_for_the_next_step(pool):
    """Idle workers killed (the OOM killer, a kill -9; a SIGTERM to the process group no longer
    reaches them: test_workers_ignore_a_stop_signal_meant_for_the_driver); the next step's calls still score."""
    import os
    import signal

    import psutil

    assert [o.value for o in pool.score(_calls("7", "8"))] == [1.0, 0.0]  # the workers are up
    workers = [p for p in psutil.Process().children() if "spawn_main" in " ".join(p.cmdline())]
    assert len(workers) == 2
    for worker in workers:
        os.kill(worker.pid, signal.SIGKILL)
    _wait_until_dead(workers)
    assert [o.value for o in pool.score(_calls("8", "7", "7"))] == [0.0, 1.0, 1.0]


def test_closing_a_pool_whose_idle_worker_was_killed_returns_and_leaves_no_worker(pool):
    """The end of a run after the OOM killer took an idle reward worker: the executor SIGTERMs the
    other, which blocks SIGTERM, and its own shutdown then waited for it forever."""
    import os
    import signal
    import threading

    import psutil

    assert [o.value for o in pool.score(_calls("7", "8"))] == [1.0, 0.0]  # both workers are up
    workers = [p for p in psutil.Process().children() if "spawn_main" in " ".join(p.cmdline())]
    assert len(workers) == 2
    os.kill(workers[0].pid, signal.SIGKILL)
    _wait_until_dead(workers[:1])
    closing = threading.Thread(target=pool.close, daemon=True)
    closing.start()
    closing.join(timeout=60)
    assert not closing.is_alive(), "RewardPool.close did not return"
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert alive == []


def test_workers_that_die_while_loading_the_reward_stop_the_run_naming_it(tmp_path, monkeypatch):
    (tmp_path / "exits_on_import.py").write_text("import os\nos._exit(4)\n\ndef score(p, r, l, m):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    pool = RewardPool("exits_on_import.py:score", num_workers=2, timeout_s=5.0)
    try:
        with pytest.raises(RunFailed, match="the reward workers exit before scoring any call: loading "
                                            "reward.function 'exits_on_import.py:score'"):
            pool.score(_calls("7", "8"))
    finally:
        pool.close()


def test_in_process_scoring_has_the_same_rules():
    def reward(prompt, response, label, metadata):
        return True if label == "bool" else 0.5

    outcomes = score_calls(reward, _calls("x", "bool"), timeout_s=5)
    assert outcomes[0].value == 0.5
    assert outcomes[1].value is None and "finite number" in outcomes[1].error


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
def test_workers_ignore_a_stop_signal_meant_for_the_driver(pool, signal_name):
    """A terminal's Ctrl-C, or a job runner's SIGTERM to the process group, reaches the workers too;
    the driver decides what it means."""
    import os
    import signal

    import psutil

    assert [o.value for o in pool.score(_calls("7", "8"))] == [1.0, 0.0]  # the workers are up
    def live_workers():
        return {p.pid for p in psutil.Process().children()
                if "spawn_main" in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE}

    workers = live_workers()
    assert len(workers) == 2
    for pid in workers:
        os.kill(pid, signal.Signals[signal_name])
    assert [o.value for o in pool.score(_calls("8", "7"))] == [0.0, 1.0]
    assert live_workers() == workers  # the same workers served these calls: none died, none was replaced


WORKING_DIR_MADE_AGAIN = '''
import os, shutil, sys
from rlsys.rewards.pool import RewardPool
from rlsys.records import RewardCall

job = sys.argv[1]
os.chdir(job)
source = open("user_rewards.py").read()
shutil.rmtree(job)  # what Ray's runtime env does to a fresh cluster's first job: deletes its working_dir ...
os.makedirs(job)    # ... and unpacks it again at the same path
open(os.path.join(job, "user_rewards.py"), "w").write(source)
pool = RewardPool("user_rewards.py:by_label", num_workers=1, timeout_s=5.0)
try:
    print([o.value for o in pool.score([RewardCall(prompt="p", response="7", label="7", metadata={})])])
finally:
    pool.close()
'''


def test_a_working_directory_deleted_and_made_again_under_the_driver_still_scores(tmp_path):
    """A fresh Ray cluster's first job (deploy/submit.sh): the driver's working directory was deleted
    and unpacked again before the reward pool started; its spawn used to fail with FileNotFoundError."""
    import subprocess
    import sys

    job = tmp_path / "_ray_pkg_0123"
    job.mkdir()
    (job / "user_rewards.py").write_text(REWARDS)
    result = subprocess.run([sys.executable, "-c", WORKING_DIR_MADE_AGAIN, str(job)], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[1.0]"
