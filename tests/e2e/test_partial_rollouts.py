"""Partial rollouts (rollout.mode partial) in whole runs on real engines: the quickstart task
still learns, every prompt drawn is trained once or still in flight, and a checkpoint taken with
aborted samples in flight resumes them exactly. (The round on real engines, token by token across
a sync: tests/e2e/test_weight_sync.py; many steps and an age bound with stand-in engines:
tests/unit/test_partial_rollouts.py.)"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys

from rlsys.observability.metrics import read_metrics
from tests.helpers import REPO, train_command

PER_STEP = 32  # quickstart's data.prompts_per_step


def _position(row: dict, train_size: int) -> int:
    return row["data_epoch"] * train_size + row["data_index"]


def _check_prompts_trained_once_or_in_flight(rows: list[dict], per_step: int, train_size: int) -> None:
    """The prompts drawn by the end of step s (the next step's data position) are the groups trained
    so far plus the groups carried out of step s: none dropped, none trained twice."""
    for before, after in zip(rows, rows[1:], strict=False):
        assert after["partial_groups_carried_in"] == before["partial_groups_carried"]
        assert _position(after, train_size) == (before["step"] + 1) * per_step + before["partial_groups_carried"]


def test_partial_rollouts_learn_the_quickstart_task(tmp_path, tiny_model_dir, ray_address, disaggregated_engines):
    run_dir = tmp_path / "run"
    result = subprocess.run(train_command("quickstart_disaggregated.yaml", tiny_model_dir, run_dir,
                                          "trainer.num_ranks=1", "rollout.num_engines=1",
                                          "rollout.engine.context_length=320", "trainer.total_steps=150",
                                          "eval.stop_at_reward=0.9", "rollout.mode={type: partial, oversample: 8}",
                                          "weight_sync.verify=false", ray_address, disaggregated_engines),
                            cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(len(rows)))
    assert rows[0]["partial_groups_carried_in"] == 0 and rows[0]["data_index"] == 0
    _check_prompts_trained_once_or_in_flight(rows, PER_STEP, 800)
    assert all(r["partial_groups_carried"] <= 8 for r in rows)  # 32 + 8 in flight, 32 trained a step
    # groups finished beyond the step's 32 wait for the next step: trained a version later
    assert max(r["partial_age_max"] for r in rows) >= 1
    assert all(r["tis_weight_mean"] > 0 for r in rows)  # TIS is on by default with partial rollouts
    assert rows[-1]["eval_reward_mean"] >= 0.9 and len(rows) < 150  # eval 0.9 ended the run (~step 70-80)


def _long_tail_bench():
    spec = importlib.util.spec_from_file_location("long_tail", REPO / "bench" / "long_tail.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_checkpoint_with_aborted_samples_in_flight_resumes_them_exactly(tmp_path, tiny_model_dir, ray_address,
                                                                           disaggregated_engines):
    """The bench's long-tailed copy task (most answers 2-4 tokens, a few up to 256): steps stop
    before their slowest groups, whose samples are aborted part-way and continued later. Both runs
    attach to the session's disaggregated set (the task's layout and context), each giving it its
    own weights at start."""
    bench = _long_tail_bench()
    train, evaluation = bench.write_task(tmp_path)
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)  # the session's tiny model (the set serves its config and tokenizer)
    bench.fine_tune(model, train, steps=120)  # answers as long as their prompts from the first step
    config = bench.config(tmp_path, model, train, evaluation)

    def train_run(run_dir, *overrides):
        return subprocess.run([sys.executable, "-m", "rlsys.cli", "train", str(config), f"run_dir={run_dir}",
                               "logging.progress_bar=false", "status.port=0", "rollout.mode=partial",
                               "trainer.total_steps=12", "checkpoint.interval=6", "eval.interval=100", ray_address,
                               disaggregated_engines, *overrides],
                              cwd=REPO, capture_output=True, text=True, timeout=1200)

    run_dir = tmp_path / "run"
    result = train_run(run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(12))
    _check_prompts_trained_once_or_in_flight(rows, 16, 2000)
    assert sum(r["aborted_samples"] for r in rows) > 0 and sum(r["partial_samples_continued"] for r in rows) > 0
    assert max(r["partial_age_max"] for r in rows) >= 1

    # The step-6 checkpoint holds the groups in flight after step 5, aborted samples with their
    # tokens among them (the long copies are never done within one step).
    saved = json.loads((run_dir / "checkpoints" / "step_00000006" / "coordinator.json").read_text())
    groups = saved["partial_groups"]
    assert len(groups) == rows[5]["partial_groups_carried"] > 0
    unfinished = [s for g in groups for s in g["samples"] if s is None or s["finish_reason"] == "abort"]
    assert len(unfinished) == rows[5]["partial_samples_carried"]
    aborted = [s for s in unfinished if s is not None and s["response_ids"]]
    assert aborted
    assert all(len(s["token_versions"]) == len(s["response_ids"]) == len(s["logprobs"]) for s in aborted)

    resumed_dir = tmp_path / "resumed"
    shutil.copytree(run_dir, resumed_dir)
    shutil.rmtree(resumed_dir / "checkpoints" / "step_00000012")
    result = train_run(resumed_dir, "checkpoint.resume=auto")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming from" in result.stdout and "step_00000006" in result.stdout
    resumed = read_metrics(resumed_dir / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(12))
    assert resumed[:6] == rows[:6]
    # step 6 starts from exactly what the checkpoint carried: the same groups, the same partial samples
    for key in ("data_epoch", "data_index", "partial_groups_carried_in", "partial_samples_continued"):
        assert resumed[6][key] == rows[6][key], key
    _check_prompts_trained_once_or_in_flight(resumed, 16, 2000)
