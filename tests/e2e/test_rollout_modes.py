"""A new rollout mode is its config variant, its runner and a test: the toy `reuse` mode of
tests/toy_rollout_mode.py (imported by the process that runs `rlsys train`, as a user's own mode
would be by their launcher) runs a whole run on the session's engines through the loop, with no
edit of rlsys: its config section read and written back, its batches trained, its off-policy TIS on."""

from __future__ import annotations

import subprocess
import sys

import yaml

from rlsys.observability.metrics import read_metrics
from tests.helpers import REPO, train_command

WITH_THE_TOY_MODE = "import sys, tests.toy_rollout_mode; from rlsys.cli import entry; sys.argv[0] = 'rlsys'; entry()"


def test_a_rollout_mode_of_ones_own_runs_a_whole_run(tmp_path, tiny_model_dir, ray_address, quickstart_engines):
    run_dir = tmp_path / "run"
    command = train_command("quickstart.yaml", tiny_model_dir, run_dir, "trainer.total_steps=4", "eval.interval=100",
                            "rollout.mode={type: reuse, reuse: 2}", ray_address, quickstart_engines)
    assert command[1:3] == ["-m", "rlsys.cli"]
    result = subprocess.run([sys.executable, "-c", WITH_THE_TOY_MODE, *command[3:]], cwd=REPO, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [r["batch_reused"] for r in rows] == [0, 1, 0, 1]
    # a reused batch is the same prompts: the data position moves only when a batch is generated
    assert rows[1]["data_index"] == rows[0]["data_index"] and rows[2]["data_index"] > rows[1]["data_index"]
    assert rows[1]["reward_mean"] == rows[0]["reward_mean"]
    assert all(r["tis_weight_mean"] > 0 for r in rows)  # off_policy: corrections default to TIS
    written = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert written["rollout"]["mode"] == {"type": "reuse", "reuse": 2}
