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
