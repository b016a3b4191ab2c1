"""reward.judge: a tiny judge model (rlsys make-tiny-judge) on an SGLang engine the run starts for it
grades the quickstart's answers, and the run learns from its grades; its engine killed mid-run is
restarted from the judge's own files (it is never synced) and the run goes on. The judge engine's
start and death are the subject (own_engines); the policy runs on the session's quickstart engines."""

from __future__ import annotations

import json
import time

import psutil
import pytest

from tests.helpers import started_run


@pytest.fixture(scope="module")
def tiny_judge_dir(tmp_path_factory):
    from rlsys.tools.tiny_judge import make_tiny_judge

    directory = tmp_path_factory.mktemp("tiny-judge")
    quality = make_tiny_judge(directory)
    assert quality["accuracy"] == 1.0, quality  # the judge is right on every answer the policy can give
    return directory


def _judge_servers(judge_dir) -> list[psutil.Process]:
    servers = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if "sglang.launch_server" in cmdline and str(judge_dir) in cmdline:
            servers.append(process)
    return servers


def _rows(run_dir) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.own_engines
def test_a_judge_on_its_own_engine_grades_the_task_the_run_learns_and_its_death_is_survived(
        tmp_path, tiny_model_dir, tiny_judge_dir, ray_address, quickstart_engines):
    run_dir = tmp_path / "run"
    with started_run("examples/judge_quickstart.yaml", tiny_model_dir, run_dir, f"reward.judge.model={tiny_judge_dir}",
                     "trainer.total_steps=200", "eval.interval=10", "eval.stop_at_reward=0.5", ray_address,
                     quickstart_engines) as run:
        deadline = time.monotonic() + 600
        while len(_rows(run_dir)) < 3:
            assert run.poll() is None and time.monotonic() < deadline, run.stderr.read()[-3000:]
            time.sleep(0.3)
        killed = _judge_servers(tiny_judge_dir)
        assert len(killed) == 1
        killed[0].kill()
        _, stderr = run.communicate(timeout=900)
    assert run.returncode == 0, stderr[-3000:]
    rows = _rows(run_dir)
    assert rows[0]["eval_reward_mean"] < 0.1  # an untrained policy: right about 1 time in 80
    assert rows[-1]["eval_reward_mean"] >= 0.5  # eval.stop_at_reward reached: the judge's grades taught it
    assert len(rows) < 200
    assert "engine-0 died; restarting it (1 of 3)" in stderr  # the judge's engine, restarted ...
    assert all(row["engine_restarts"] == 0 for row in rows)  # ... not the policy's
    assert sum(row["reward_errors"] for row in rows) == 0  # its requests in flight were sent again
    assert [p.pid for p in _judge_servers(tiny_judge_dir)] == []  # stopped with the run
