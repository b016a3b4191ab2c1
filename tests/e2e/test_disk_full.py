"""A disk that fills up under a run: the run fails with one line naming the file system and its free
space, its status says `failed`, and it resumes from its last whole checkpoint once there is room.
(Each writer on a full disk, without a run: tests/unit/test_disk_full.py.)"""

from __future__ import annotations

import json
import subprocess
import sys

from rlsys.run.checkpointing import CheckpointStore
from tests.helpers import REPO, train_command
from tests.unit.test_disk_full import _temporary_files


def test_a_run_whose_disk_fills_up_fails_clearly_and_resumes_from_its_last_checkpoint(small_disk, tiny_model_dir,
                                                                                        ray_address, quickstart_engines):
    """Each checkpoint of the tiny model takes 2 MB: the second does not fit on the 3 MB disk."""
    run_dir = small_disk / "run"
    failed = subprocess.run(train_command("quickstart.yaml", tiny_model_dir, run_dir, "trainer.total_steps=40",
                                          "checkpoint.interval=2", "eval.interval=100", ray_address, quickstart_engines),
                            cwd=REPO, capture_output=True, text=True, timeout=900)
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert "Traceback" not in failed.stderr, failed.stderr[-3000:]
    [line] = [line for line in failed.stderr.splitlines() if line.startswith("rlsys: ")]
    assert line.startswith(f"rlsys: run failed: no space left on the device of {run_dir}")
    assert "MiB free of 3.0 MiB there; free some space, then --resume continues from " in line
    assert line.endswith("step_00000002")
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "failed" and status["error"] == line.removeprefix("rlsys: run failed: ")
    assert _temporary_files(run_dir) == []
    assert [p.name for p in CheckpointStore(run_dir).complete_checkpoints()] == ["step_00000002"]
    listing = subprocess.run([sys.executable, "-m", "rlsys.cli", "runs", str(small_disk)],
                             capture_output=True, text=True, timeout=120)
    assert "│ run " in listing.stdout and "│ failed " in listing.stdout, listing.stdout

    # More room, and a metrics row cut off as a kill in the middle of an append leaves it
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    steps_logged = len((run_dir / "metrics.jsonl").read_text().splitlines())
    with (run_dir / "metrics.jsonl").open("a") as metrics:
        metrics.write(json.dumps({"step": steps_logged, "reward_mean": 0.5})[:20])
    resumed = subprocess.run(train_command("quickstart.yaml", tiny_model_dir, run_dir, "trainer.total_steps=4",
                                           "checkpoint.interval=2", "eval.interval=100", ray_address, quickstart_engines,
                                           "--resume"),
                             cwd=REPO, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout and "step_00000002" in resumed.stdout
    assert f"{run_dir / 'metrics.jsonl'}:{steps_logged + 1}: the last line is cut off" in resumed.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and [r["weight_version"] for r in rows] == [0, 1, 2, 3]
