"""The asynchronous pipeline (rollout.mode async, max_staleness=N, disaggregated), at N=2: it overlaps, learns,
and resumes from a checkpoint taken with batches ahead in flight without losing or repeating a
prompt. (N=1, one step off-policy, is the same code with one batch ahead; its queue, bound and
drops: tests/unit/test_batches_ahead.py.)"""

import os
import shutil
import subprocess

import pytest

from rlsys.observability.metrics import read_metrics
from tests.e2e.test_dashboard_browser import CHROMIUM, _chromium
from tests.helpers import REPO, served_run_dir, train_command


def test_staleness_two_overlaps_learns_and_resumes_exactly(tmp_path, tiny_model_dir, ray_address,
                                                           disaggregated_engines):
    overrides = ("trainer.num_ranks=1", "rollout.num_engines=1", "rollout.engine.context_length=320",
                 "rollout.mode={type: async, max_staleness: 2}",
                 "trainer.total_steps=100", "checkpoint.interval=70", "weight_sync.verify=false", ray_address,
                 disaggregated_engines)
    run_dir = tmp_path / "run"
    result = subprocess.run(train_command("quickstart_disaggregated.yaml", tiny_model_dir, run_dir, *overrides),
                            cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(100))

    # Every step after the first trains a batch generated while earlier steps trained; the samples
    # of a step came from weights at most two versions behind, never more (how far behind depends
    # on whether the engine or the trainer is faster: bounds only).
    assert "prefetch_s" not in rows[0] and all(r["prefetch_s"] > 0 for r in rows[1:])
    assert all(0.0 <= r["staleness_mean"] <= 2.0 for r in rows)
    for r in rows:  # the histogram: the share of samples 0, 1 and 2 versions behind
        assert r["staleness_0"] + r["staleness_1"] + r["staleness_2"] == pytest.approx(1.0)
        assert r["staleness_mean"] == pytest.approx(r["staleness_1"] + 2 * r["staleness_2"])
        assert r.get("stale_dropped_samples", 0) == 0  # none is older than 2 versions by construction
    assert sum(r["staleness_mean"] for r in rows[1:]) / 99 > 0.5  # off-policy most of the time
    assert rows[0]["staleness_mean"] == 0.0  # the first batch is generated before any training
    assert all(r["tis_weight_mean"] > 0 for r in rows)  # TIS is on by default with staleness above 0
    # ... and the prompts advance by one batch a step: none skipped, none drawn twice
    per_step = 32
    positions = [r["data_epoch"] * 800 + r["data_index"] for r in rows]
    assert positions == [step * per_step for step in range(100)]
    assert max(r["eval_reward_mean"] for r in rows if "eval_reward_mean" in r) >= 0.9
    assert rows[-1]["eval_reward_mean"] >= 0.9

    # The dashboard's timeline draws each step's overlapped generation of the next batch as a
    # second lane (the last 60 steps are shown; the newest has no next batch).
    if CHROMIUM or os.environ.get("CI"):
        with served_run_dir(run_dir) as url:
            dom = _chromium("--dump-dom", f"{url}/")
        assert dom.count('data-phase="next-batch"') == 59, dom[:2000]

    # Resume from the step-70 checkpoint (taken with steps 70 and 71's batches ahead, mid-epoch: 25
    # steps an epoch): steps 70..99, across the epoch boundary at 75, run again on exactly the
    # prompts the uninterrupted run used.
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(run_dir, resumed_dir)
    shutil.rmtree(resumed_dir / "checkpoints" / "step_00000100")
    result = subprocess.run(train_command("quickstart_disaggregated.yaml", tiny_model_dir, resumed_dir, *overrides,
                                          "checkpoint.resume=auto"), cwd=REPO, capture_output=True, text=True,
                            timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming from" in result.stdout
    resumed = read_metrics(resumed_dir / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(100))
    assert [(r["data_epoch"], r["data_index"]) for r in resumed] == [(r["data_epoch"], r["data_index"]) for r in rows]
    assert resumed[70]["staleness_mean"] == 0.0  # step 70's batch was generated again, from the resumed weights
    assert resumed[:70] == rows[:70]  # the steps before the checkpoint are the original's, kept
