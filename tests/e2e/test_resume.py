"""A killed run resumes from its last checkpoint: same data order, engine on the resumed weights, and
the same samples and metrics as the run that was never killed."""

import json
import subprocess
import sys
import time

import pytest
import torch

from rlsys.observability.metrics import read_metrics
from rlsys.system.run_lock import owner_is_alive
from tests.helpers import REPO, differing_metrics


def _command(run_dir, model_dir, *extra):
    return [
        sys.executable, "-m", "rlsys.cli", "train", str(REPO / "configs/quickstart.yaml"),
        f"model.path={model_dir}", f"run_dir={run_dir}", "logging.progress_bar=false",
        "trainer.total_steps=6", "checkpoint.interval=2", "eval.interval=100",
        "algorithm.use_kl_loss=true", "algorithm.kl_coef=0.01", "status.port=0", *extra,
    ]


@pytest.mark.own_engines
def test_a_killed_driver_leaves_nothing_and_the_run_resumes_where_its_checkpoint_left_off(leftovers, tmp_path,
                                                                                          tiny_model_dir, ray_address,
                                                                                          quickstart_engines):
    """The driver alone dies without warning (SIGKILL) after its step-4 checkpoint: its reaper stops
    the engines, trainers and Ray, the status says failed, the lock is stale; `--resume` then
    continues from step 4 as if nothing had happened."""
    run_dir = tmp_path / "run"
    crashed = subprocess.Popen(_command(run_dir, tiny_model_dir), cwd=REPO,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoint = run_dir / "checkpoints" / "step_00000004" / "coordinator.json"
    deadline = time.monotonic() + 600
    while not checkpoint.exists() and time.monotonic() < deadline and crashed.poll() is None:
        time.sleep(0.2)
    assert checkpoint.exists(), "the run never wrote its step-4 checkpoint"
    crashed.kill()
    crashed.wait()
    killed_at = time.monotonic()
    while (leftovers.processes() or leftovers.shm_files()) and time.monotonic() - killed_at < 120:  # waits, never a measure
        time.sleep(0.5)
    assert leftovers.processes() == [] and leftovers.shm_files() == []
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "failed" and "died without finishing" in status["error"]
    assert not owner_is_alive(run_dir)  # the stale lock will not block the next start

    # what the resumed run leaves is not looked at: it joins the session's cluster and its standing engines
    resumed = subprocess.run(_command(run_dir, tiny_model_dir, ray_address, quickstart_engines, "--resume"), cwd=REPO,
                             capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout and "step_00000004" in resumed.stdout

    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(6))  # no step lost, none logged twice
    # data: 32 prompts per step from one shuffled epoch, continuing exactly where it stopped
    assert [(r["data_epoch"], r["data_index"]) for r in rows] == [(0, 32 * s) for s in range(6)]
    # the engine restarted on the checkpointed weights and version, not the initial ones
    assert rows[4]["weight_version"] == 4
    assert rows[4]["logprob_mismatch"] < 1e-3
    assert rows[0]["kl"] == 0.0 and rows[5]["kl"] > 0.0
    # ... and it computed what the uninterrupted run computes, metric for metric, exactly: each sample's
    # seed comes from the data position the checkpoint restored (rollout/seeds.py), so the resumed steps
    # drew the tokens the uninterrupted run draws, though steps 0-3 ran on an engine of their own and
    # 4-5 on the session's
    uninterrupted = subprocess.run(_command(tmp_path / "uninterrupted", tiny_model_dir, ray_address, quickstart_engines),
                                   cwd=REPO, capture_output=True, text=True, timeout=900)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    assert differing_metrics(rows, read_metrics(tmp_path / "uninterrupted" / "metrics.jsonl")) == []

    export = subprocess.run(
        [sys.executable, "-m", "rlsys.cli", "export", str(run_dir), str(tmp_path / "hf"), "--step", "6"],
        capture_output=True, text=True, timeout=300,
    )
    assert export.returncode == 0, export.stderr[-2000:]
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    initial = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    changed = max((a - b).abs().max().item() for a, b in zip(
        exported.state_dict().values(), initial.state_dict().values(), strict=True))
    assert changed > 1e-4  # the export holds the trained weights
