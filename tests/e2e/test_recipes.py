"""The recipe configs learn the quickstart task as shipped, and show their options in the metrics.
(The CISPO recipe learns on each architecture in tests/e2e/test_architectures.py.)

The Dr. GRPO run takes its rewards from a reward service (reward.url) that this test serves: the
same exact-match scores as the recipe's reward.function, through the HTTP path instead.
"""

import subprocess

from rlsys.observability.metrics import read_metrics
from tests.helpers import REPO, RewardService, train_command


def _run(recipe: str, tiny_model_dir, run_dir, ray_address, *overrides) -> list[dict]:
    """The recipe's run in the session's Ray cluster, ended by its first eval at 0.9 or more (the
    asserts check the last eval)."""
    result = subprocess.run(train_command(f"recipes/{recipe}", tiny_model_dir, run_dir, "eval.stop_at_reward=0.9",
                                          ray_address, *overrides),
                            capture_output=True, text=True, timeout=1500, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    return read_metrics(run_dir / "metrics.jsonl")


def _evals(rows):
    return [r["eval_reward_mean"] for r in rows if r.get("eval_reward_mean") is not None]


def test_dapo_recipe_learns_with_dynamic_sampling(tmp_path, tiny_model_dir, ray_address, quickstart_engines):
    rows = _run("dapo.yaml", tiny_model_dir, tmp_path / "run", ray_address, quickstart_engines)
    evals = _evals(rows)
    assert evals[0] < 0.3 and evals[-1] >= 0.9, f"eval reward over the run: {evals}"
    # Dynamic sampling: at first most groups score all alike and are dropped, so more rounds run;
    # a step trains on at most prompts_per_step groups, and once the model learns, most are kept.
    assert rows[0]["filtered_groups"] > 32 and rows[0]["sampling_rounds"] == 3
    assert all(1 <= r["sampling_rounds"] <= 3 and 0 < r["train_groups"] <= 32 for r in rows)
    assert rows[-1]["filtered_groups"] < rows[0]["filtered_groups"]


def test_dr_grpo_recipe_learns_with_rewards_from_a_reward_service(tmp_path, tiny_model_dir, ray_address, quickstart_engines):
    service = RewardService()
    try:
        rows = _run("dr_grpo.yaml", tiny_model_dir, tmp_path / "run", ray_address, quickstart_engines,
                    f"reward.url={service.url}")
    finally:
        service.close()
    evals = _evals(rows)
    assert evals[0] < 0.3 and evals[-1] >= 0.9, f"eval reward over the run: {evals}"
    scored = sum(len(batch) for batch in service.requests)
    assert scored >= len(rows) * 32 * 8  # every training sample (and the evals) went through the service
    assert all(r["reward_errors"] == 0 for r in rows)
    # advantage_estimator none: advantages are centred rewards, |A| <= 1 for 0/1 rewards
    assert all(0.0 <= r["advantage_abs_mean"] <= 1.0 for r in rows)


def test_gspo_recipe_learns_clipping_whole_responses(tmp_path, tiny_model_dir, ray_address, quickstart_engines):
    rows = _run("gspo.yaml", tiny_model_dir, tmp_path / "run", ray_address, quickstart_engines)
    evals = _evals(rows)
    assert evals[0] < 0.3 and evals[-1] >= 0.9, f"eval reward over the run: {evals}"
    # the second mini-batch of each step is off-policy: some of its responses leave the narrow
    # sequence-level trust region and are clipped whole
    assert any(r["seq_clip_fraction"] > 0 for r in rows)
    assert all(0.0 <= r["seq_clip_fraction"] <= 1.0 for r in rows)
