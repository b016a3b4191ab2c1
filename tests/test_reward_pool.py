"""Reward calls in worker processes: a reward that raises, returns a non-number, hangs or kills its
worker gives a counted error outcome, the other calls keep their values, and the pool recovers."""

import time

import pytest

from rlsys.reward_pool import RewardCall, RewardPool, score_calls

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


def test_a_worker_that_dies_fails_its_chunk_and_is_replaced(pool):
    outcomes = pool.score(_calls("die", "7"))
    assert outcomes[0].error is not None and "worker" in outcomes[0].error
    assert [o.value for o in pool.score(_calls("7", "8"))] == [1.0, 0.0]  # a fresh pool serves the next step


def test_in_process_scoring_has_the_same_rules():
    def reward(prompt, response, label, metadata):
        return True if label == "bool" else 0.5

    outcomes = score_calls(reward, _calls("x", "bool"), timeout_s=5)
    assert outcomes[0].value == 0.5
    assert outcomes[1].value is None and "finite number" in outcomes[1].error


def test_workers_ignore_a_ctrl_c_meant_for_the_driver(pool):
    """A terminal's Ctrl-C reaches the workers too; the driver decides what it means."""
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
        os.kill(pid, signal.SIGINT)
    assert [o.value for o in pool.score(_calls("8", "7"))] == [0.0, 1.0]
    assert live_workers() == workers  # the same workers served these calls: none died, none was replaced
