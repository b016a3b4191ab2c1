"""Fault injection: an engine that dies mid-run (colocated: IPC transport; disaggregated: one of two
engines in the broadcast group) stops the run with a clear message, cleanly."""

import json
import os
import signal
import subprocess
import time

import pytest

from tests.conftest import REPO, Leftovers, train_command


@pytest.mark.slow
@pytest.mark.parametrize(("config", "engines"), [("quickstart.yaml", 1), ("quickstart_disaggregated.yaml", 2)])
def test_engine_killed_mid_run_fails_the_run_with_a_clear_message(tmp_path, tiny_model_dir, config, engines):
    leftovers = Leftovers()
    run_dir = tmp_path / "run"
    run = subprocess.Popen(
        train_command(config, tiny_model_dir, run_dir, "trainer.total_steps=2000"),
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 600
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert run.poll() is None and time.monotonic() < deadline, run.stderr.read()[-3000:]
            time.sleep(0.3)
        servers = [p for p in leftovers.new_pids("sglang.launch_server")
                   if str(tiny_model_dir) in " ".join(p.info["cmdline"] or [])]
        assert len(servers) == engines
        os.kill(servers[-1].pid, signal.SIGKILL)  # an engine's server dies without warning

        _, stderr = run.communicate(timeout=300)
        assert run.returncode == 1
        assert "rlsys: run failed: a trainer rank or rollout engine failed" in stderr
        assert "SGLang server" in stderr
        assert json.loads((run_dir / "status.json").read_text())["state"] == "failed"
        time.sleep(2)
        assert leftovers.processes() == []
        assert leftovers.shm_files() == []
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()


BAD_REWARDS = '''
import time

def hangs_or_lies(prompt, response, label, metadata):
    if label == "7":
        time.sleep(60)  # hangs: stopped at reward.timeout_s
    if label == "3":
        return "1.0"  # not a number
    return float(response.strip() == label)
'''


@pytest.mark.slow
def test_hanging_and_non_number_rewards_are_counted_and_the_run_finishes(tmp_path, tiny_model_dir):
    (tmp_path / "bad_rewards.py").write_text(BAD_REWARDS)
    run_dir = tmp_path / "run"
    start = time.monotonic()
    result = subprocess.run(
        train_command("quickstart.yaml", tiny_model_dir, run_dir, "trainer.total_steps=3", "eval.interval=2",
                      "reward.function=bad_rewards.py:hangs_or_lies", "reward.timeout_s=0.2"),
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    # last_digit prompts end in 7 or 3 about one time in five: their groups are dropped, each counted
    assert all(r["reward_errors"] > 0 and r["reward_errors"] == 8 * r["dropped_groups"] for r in rows)
    evals = [r for r in rows if "eval_reward_mean" in r]
    assert [r["step"] for r in evals] == [0, 2] and all(r["eval_reward_errors"] > 0 for r in evals)
    assert time.monotonic() - start < 300  # no call was allowed its 60 s
