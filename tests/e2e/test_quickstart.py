"""End to end: the CPU quickstart learns, logs what a user reads, and leaves nothing behind."""

import json
import re
import subprocess

import pytest
from safetensors.torch import load_file

from rlsys.observability.metrics import read_metrics
from tests.helpers import REPO, train_command

REQUIRED_COLUMNS = {
    "step", "reward_mean", "reward_std", "loss", "kl", "clip_fraction", "entropy",
    "response_len_mean", "weight_version", "logprob_mismatch", "time_generate_s",
    "time_train_s", "time_sync_s", "time_step_s", "tokens_per_s", "sync_bytes", "sync_buckets", "sync_gbps",
}


@pytest.mark.own_engines
def test_quickstart_learns_and_cleans_up(leftovers, tmp_path, tiny_model_dir):
    """The README's command, colocated. (The disaggregated layout learns in tests/e2e/test_multinode.py,
    its engine on another node, and logs to every tracking backend there.)"""
    run_dir = tmp_path / "run"
    # The GPU's memory hand-off runs on CPU too when asked: its order of calls is checked.
    # eval 0.9 by ~step 80; eval.stop_at_reward ends the run there, with a checkpoint (checkpoint.interval set)
    result = subprocess.run(
        train_command("quickstart.yaml", tiny_model_dir, run_dir, "trainer.offload_between_steps=true",
                      "eval.stop_at_reward=0.9", "checkpoint.interval=1000", "logging.save_rollouts=true"),
        capture_output=True, text=True, timeout=1200, cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert str(run_dir) in result.stdout  # the run directory is printed
    assert "rlsys: data: 800 train and 100 eval prompts" in result.stdout  # what was loaded, and dropped
    dataset = json.loads((run_dir / "status.json").read_text())["dataset"]
    assert dataset == {"train_prompts": 800, "eval_prompts": 100, "skipped_rows": 0, "too_long_prompts": 0}

    rows = read_metrics(run_dir / "metrics.jsonl")
    assert (run_dir / "config.yaml").is_file()
    assert [r["step"] for r in rows] == list(range(len(rows)))
    for row in rows:
        assert REQUIRED_COLUMNS <= row.keys()
    evals = [r["eval_reward_mean"] for r in rows if r.get("eval_reward_mean") is not None]
    assert evals[0] < 0.3, "an untrained model must not solve the task"
    assert evals[-1] >= 0.9 and max(evals[:-1]) < 0.9, f"eval reward over the run: {evals}"
    assert "eval_reward_mean" in rows[-1] and len(rows) < 200  # the run ended with the step whose eval reached 0.9
    assert "reached eval.stop_at_reward 0.9" in result.stdout
    # no progress bar: a line per eval, and step summaries (the first and the last step's at least)
    eval_lines = [line for line in result.stdout.splitlines() if re.match(r"rlsys: step \d+/\d+: eval_reward_mean ", line)]
    assert [float(line.rsplit(" ", 1)[1]) for line in eval_lines] == pytest.approx(evals, abs=5e-4)
    summaries = re.findall(r"rlsys: step (\d+)/\d+: reward [-\d.e]+, loss ", result.stdout)
    assert summaries[0] == "1" and summaries[-1] == str(len(rows))
    assert json.loads((run_dir / "status.json").read_text())["state"] == "finished"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"step_{len(rows):08d}"]
    # the engine's weights advance one version per step and match the trainer (fp32)
    assert [r["weight_version"] for r in rows] == list(range(len(rows)))
    assert max(r["logprob_mismatch"] for r in rows) < 1e-3
    # each sync hands the engine the whole model once (fp32; colocated adds <16 B of alignment a tensor)
    weights = load_file(tiny_model_dir / "model.safetensors")
    model_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    assert all(model_bytes <= r["sync_bytes"] < model_bytes + 16 * len(weights) and r["sync_gbps"] > 0 for r in rows)
    _check_device_handoff(run_dir, rows)
    _check_saved_rollouts(run_dir, rows)

    assert leftovers.processes() == []
    assert leftovers.shm_files() == []


def _check_saved_rollouts(run_dir, rows):
    """logging.save_rollouts: every step's 32 x 8 trained samples, as the metrics counted them."""
    from rlsys.observability.rollouts import read_rollouts

    steps = read_rollouts(run_dir / "rollouts")
    assert len(steps) == len(rows)
    for samples, row in zip(steps, rows, strict=True):
        assert len(samples) == 32 * 8
        assert sum(s["reward"] for s in samples) / len(samples) == pytest.approx(row["reward_mean"], abs=1e-6)
        assert all(len(s["response_ids"]) == len(s["engine_logprobs"]) == 1 for s in samples)  # max_new_tokens 1
        assert all(s["weight_version"] == row["weight_version"] for s in samples)
        for group in range(32):  # group-normalised advantages sum to 0 within each group
            assert sum(s["advantage"] for s in samples[group * 8:(group + 1) * 8]) == pytest.approx(0.0, abs=1e-5)
            assert len({s["prompt"] for s in samples[group * 8:(group + 1) * 8]}) == 1


HANDOFF_STEP = ["engines_release", "trainer_wake", "trainer_release_cache", "engines_resume_weights", "trainer_sleep",
                "engines_resume_all"]


def _check_device_handoff(run_dir, rows):
    """Colocated: every step, the engines release their memory before the trainer wakes, take their
    weights back before the sync but after the trainer has emptied its cache of the train step, and
    their KV cache only after the trainer sleeps; each side's bytes are in the metrics."""
    events = [json.loads(line) for line in (run_dir / "logs" / "device_handoff.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events[:1]] == ["trainer_sleep"]  # after the first weight push
    for step in range(len(rows)):
        this_step = [e for e in events if e["step"] == step]
        assert [e["event"] for e in this_step] == HANDOFF_STEP, step
        released = {e["event"]: [sorted(engine["released"]) for engine in e.get("engines", [])] for e in this_step}
        assert released["engines_release"] == [["cuda_graph", "kv_cache", "weights"]]
        assert released["engines_resume_weights"] == [["cuda_graph", "kv_cache"]]  # weights back for the sync
        assert released["engines_resume_all"] == [[]]
    for key in ("memory_engine_serving_bytes", "memory_engine_released_bytes", "memory_trainer_awake_bytes",
                "memory_trainer_asleep_bytes", "offload_bytes"):
        assert all(row[key] > 0 for row in rows), key

