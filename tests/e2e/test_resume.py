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
from tests.conftest import DISAGGREGATED_CONTEXT
from tests.e2e.test_faults import _wait_for_steps
from tests.helpers import REPO, differing_metrics, server_listening_on, set_engine, started_run, train_command


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


# What a fault may change in a run's rows besides timing: the counts of what was restarted.
RESTART_COUNTS = frozenset({"engine_restarts", "trainer_restarts"})


def _killed_after_checkpoint(command: list[str], run_dir, step: int) -> None:
    """Start `command`, and SIGKILL its driver once its step-`step` checkpoint is whole."""
    crashed = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoint = run_dir / "checkpoints" / f"step_{step:08d}" / "coordinator.json"
    deadline = time.monotonic() + 600
    while not checkpoint.exists() and time.monotonic() < deadline and crashed.poll() is None:
        time.sleep(0.1)
    assert checkpoint.exists() and crashed.poll() is None, f"the run never wrote its step-{step} checkpoint"
    crashed.kill()
    crashed.wait()


def test_context_parallel_ranks_killed_and_resumed_compute_what_the_uninterrupted_run_does(
        tmp_path, tiny_model_dir, ray_address, quickstart_engines):
    """#64 item 5 with context parallelism (ring over the quickstart's 2 ranks), attached to the session's
    engines: the driver killed with SIGKILL after its step-2 checkpoint and the run resumed (a new driver,
    the set's kept ranks rebuilt from the checkpoint) logs every metric of
    every step as the uninterrupted run does, timing aside."""
    settings = ("trainer.total_steps=4", "checkpoint.interval=2", "eval.interval=100", "trainer.context_parallel_size=2",
                ray_address, quickstart_engines)
    run_dir = tmp_path / "run"
    _killed_after_checkpoint(train_command("quickstart.yaml", tiny_model_dir, run_dir, *settings), run_dir, 2)
    resumed = subprocess.run(train_command("quickstart.yaml", tiny_model_dir, run_dir, *settings, "--resume"),
                             cwd=REPO, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout and "step_00000002" in resumed.stdout
    uninterrupted = subprocess.run(train_command("quickstart.yaml", tiny_model_dir, tmp_path / "uninterrupted", *settings),
                                   cwd=REPO, capture_output=True, text=True, timeout=600)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(4))
    assert differing_metrics(rows, read_metrics(tmp_path / "uninterrupted" / "metrics.jsonl")) == []


@pytest.mark.own_engines
def test_one_rank_resumed_after_a_kill_then_its_engine_killed_computes_what_the_uninterrupted_run_does(
        tmp_path, tiny_model_dir, ray_address, disaggregated_engines):
    """#64 item 5 at one rank (the session's disaggregated set: one rank broadcasting to one engine), with
    two faults that must not change what a run computes, each judged on the steps it alone touches:
    the driver killed with SIGKILL after its step-2 checkpoint and the run resumed (steps 2-3 are those of
    a new driver), then, in the resumed run, the engine's server killed once 4 steps are logged (the run
    restarts it: steps 4-7 are drawn from a new engine, the request in flight sent again with its seed).
    Every metric of every step is the uninterrupted run's, timing and the restart counts aside.
    (An engine's death is a subject: own_engines; its restart is charged here.)"""
    settings = ("trainer.num_ranks=1", "rollout.num_engines=1", f"rollout.engine.context_length={DISAGGREGATED_CONTEXT}",
                "trainer.total_steps=8", "checkpoint.interval=2", "eval.interval=100", ray_address,
                disaggregated_engines)
    run_dir = tmp_path / "run"
    _killed_after_checkpoint(train_command("quickstart_disaggregated.yaml", tiny_model_dir, run_dir, *settings),
                             run_dir, 2)
    with started_run("quickstart_disaggregated.yaml", tiny_model_dir, run_dir, *settings, "--resume") as run:
        _wait_for_steps(run, run_dir, 4)
        assert run.poll() is None
        server_listening_on(set_engine("disaggregated")["url"]).kill()
        stdout, stderr = run.communicate(timeout=600)
    assert run.returncode == 0, stderr[-3000:]
    assert "resuming from" in stdout and "step_00000002" in stdout
    assert "engine-0 died; restarting it (1 of 3)" in stderr
    uninterrupted = subprocess.run(train_command("quickstart_disaggregated.yaml", tiny_model_dir,
                                                 tmp_path / "uninterrupted", *settings),
                                   cwd=REPO, capture_output=True, text=True, timeout=600)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(8)) and rows[-1]["engine_restarts"] == 1
    differing = differing_metrics(rows, read_metrics(tmp_path / "uninterrupted" / "metrics.jsonl"), RESTART_COUNTS)
    assert [d for d in differing if d[0] is not None and d[0] < 4] == [], "the run resumed after a SIGKILL differs"
    assert [d for d in differing if d[0] is None or d[0] >= 4] == [], "the run whose engine was killed differs"
