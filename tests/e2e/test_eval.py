"""Eval sets in a training run, and `rlsys eval` on the checkpoint it saved, against real engines."""

import json
import subprocess
import sys

import pytest

from rlsys.config import SyntheticTaskConfig
from rlsys.data.tasks import generate_task
from rlsys.observability.metrics import read_metrics
from tests.helpers import REPO, train_command

# Partial credit for any digit: a reward of the set's own, in a file (not the run's exact match).
REWARD = '''
def half_credit(prompt, response, label, metadata):
    answer = response.strip()
    return 1.0 if answer == label else 0.5 if answer.isdigit() else 0.0
'''


def test_eval_sets_report_each_metric_and_rlsys_eval_repeats_them_on_a_checkpoint(tmp_path, tiny_model_dir, ray_address,
                                                                                  quickstart_engines):
    _, held_out = generate_task(SyntheticTaskConfig(task="last_digit", num_digits=3, num_train=800, num_eval=100))
    set_file = tmp_path / "held_out.jsonl"
    set_file.write_text("".join(json.dumps({"question": r.prompt, "answer": r.label}) + "\n" for r in held_out[:40]))
    (tmp_path / "rewards.py").write_text(REWARD)
    eval_set = (f"eval.datasets=[{{name: held_out, path: {set_file}, prompt_key: question, label_key: answer, "
                f"n_samples: 4, temperature: 1.0, pass_k: [1, 2, 4], interval: 2, "
                f"reward_function: {tmp_path / 'rewards.py'}:half_credit}}]")
    run_dir = tmp_path / "run"
    # eval.interval 3 and 4 steps: the data section's set at steps 0 and 3, the held-out set at 0, 2 and 3
    result = subprocess.run(train_command("quickstart.yaml", tiny_model_dir, run_dir, "trainer.total_steps=4",
                                          "eval.interval=3", "checkpoint.interval=3", eval_set, ray_address,
                                          quickstart_engines),
                            cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rlsys: data: 800 train and 100 eval prompts; eval sets: held_out (40 prompts)" in result.stdout
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows if "eval_reward_mean" in r] == [0, 3]
    assert [r["step"] for r in rows if "eval_held_out_reward_mean" in r] == [0, 2, 3]
    for row in (r for r in rows if "eval_held_out_reward_mean" in r):
        mean, one, two, four = (row[f"eval_held_out_{key}"] for key in ("reward_mean", "pass_at_1", "pass_at_2",
                                                                         "pass_at_4"))
        # pass@k counts full successes only, and more tries never solve fewer prompts; the set's own
        # reward gives half credit for a wrong digit, so its mean lies above pass@1 (exact match,
        # the run's reward, would make them equal)
        assert 0.0 <= one <= two <= four <= 1.0 and one < mean <= 1.0, row
        assert row["eval_held_out_reward_errors"] == 0
        assert row["eval_held_out_response_len_mean"] == 1.0  # max_new_tokens: 1
        assert row["eval_held_out_truncated_fraction"] > 0.9  # cut at max_new_tokens, not stopped
    trained = rows[3]
    # the answers shown (logging.samples_per_step: 4): each step's, and each eval's at its steps
    shown = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["source"]) for r in shown if r["source"] != "train"] == \
        [(0, "eval")] * 4 + [(0, "eval:held_out")] * 4 + [(2, "eval:held_out")] * 4 + \
        [(3, "eval")] * 4 + [(3, "eval:held_out")] * 4
    assert [r["step"] for r in shown if r["source"] == "train"] == [step for step in range(4) for _ in range(4)]
    assert all(r["prompt"].endswith(">") and r["response_tokens"] == 1 and r["finish_reason"] for r in shown)
    assert {r["prompt"] for r in shown if r["source"] == "eval:held_out"} <= {p.prompt for p in held_out[:40]}

    # the checkpoint after 3 steps holds the weights step 3 was evaluated with
    checkpoint = run_dir / "checkpoints" / "step_00000003"
    evaluated = subprocess.run([sys.executable, "-m", "rlsys.cli", "eval", str(REPO / "configs/quickstart.yaml"),
                                f"model.path={tiny_model_dir}", eval_set, ray_address, quickstart_engines,
                                "--checkpoint", str(checkpoint), "--json", "--show", "2"],
                               cwd=REPO, capture_output=True, text=True, timeout=900)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    answer = json.loads(evaluated.stdout)  # stdout is the one JSON object; progress lines went to stderr
    assert answer["checkpoint"] == str(checkpoint)
    metrics = answer["metrics"]
    assert set(metrics) == {key for key in trained if key.startswith("eval_")}
    # greedy answers of the same weights: the same score (near-ties may break either way in another process)
    assert metrics["eval_reward_mean"] == pytest.approx(trained["eval_reward_mean"], abs=0.05)
    assert metrics["eval_held_out_pass_at_1"] < metrics["eval_held_out_reward_mean"]
    # --show 2: two answers of each set, in the one JSON object
    assert [sample["source"] for sample in answer["samples"]] == ["eval", "eval", "eval:held_out", "eval:held_out"]
