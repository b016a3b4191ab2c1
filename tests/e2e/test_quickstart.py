"""End to end: the CPU quickstart learns, logs what a user reads, and leaves nothing behind."""

import json
import os
import subprocess

import pytest
from safetensors.torch import load_file

from rlsys.observability.metrics import read_metrics
from tests.helpers import REPO, Leftovers, train_command

REQUIRED_COLUMNS = {
    "step", "reward_mean", "reward_std", "loss", "kl", "clip_fraction", "entropy",
    "response_len_mean", "weight_version", "logprob_mismatch", "time_generate_s",
    "time_train_s", "time_sync_s", "time_step_s", "tokens_per_s", "sync_bytes", "sync_buckets", "sync_gbps",
}


@pytest.mark.slow
@pytest.mark.parametrize("config", ["quickstart.yaml", "quickstart_disaggregated.yaml"])
def test_quickstart_learns_and_cleans_up(tmp_path, tiny_model_dir, config):
    leftovers = Leftovers()
    run_dir = tmp_path / "run"
    # Colocated, the GPU's memory hand-off runs on CPU too when asked: its order of calls is checked.
    handoff = ["trainer.offload_between_steps=true"] if config == "quickstart.yaml" else []
    # Disaggregated, the run also logs to every tracking backend (read back below).
    tracking = [] if config == "quickstart.yaml" else ["logging.backends=[tensorboard,wandb,mlflow]"]
    result = subprocess.run(  # eval 1.0 by ~step 90
        train_command(config, tiny_model_dir, run_dir, "trainer.total_steps=130", *handoff, *tracking),
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
    assert evals[-1] >= 0.9, f"eval reward over the run: {evals}"
    # the engine's weights advance one version per step and match the trainer (fp32)
    assert [r["weight_version"] for r in rows] == list(range(len(rows)))
    assert max(r["logprob_mismatch"] for r in rows) < 1e-3
    # each sync hands the engine the whole model once (fp32; colocated adds <16 B of alignment a tensor)
    weights = load_file(tiny_model_dir / "model.safetensors")
    model_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    assert all(model_bytes <= r["sync_bytes"] < model_bytes + 16 * len(weights) and r["sync_gbps"] > 0 for r in rows)
    if config == "quickstart.yaml":
        _check_device_handoff(run_dir, rows)
    else:
        assert not (run_dir / "logs" / "device_handoff.jsonl").exists()  # trainers keep their devices
        _check_tracking(run_dir, rows)

    assert leftovers.processes() == []
    assert leftovers.shm_files() == []


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


def _check_tracking(run_dir, rows):
    """TensorBoard and MLflow got every step's metrics under metrics.jsonl's names; wandb ran offline."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("reward_mean")] == [r["step"] for r in rows]
    assert [e.value for e in events.Scalars("reward_mean")] == pytest.approx([r["reward_mean"] for r in rows])
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 opens file stores only when asked
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    [run] = client.search_runs([client.get_experiment_by_name("rlsys").experiment_id])
    evals = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval_reward_mean")]
    assert sorted(evals) == [(r["step"], r["eval_reward_mean"]) for r in rows if r.get("eval_reward_mean") is not None]
    assert len(list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))) == 1
