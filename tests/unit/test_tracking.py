"""logging.backends: TensorBoard, wandb (offline) and MLflow receive the metrics.jsonl rows under
the same names, step = training step, and the config once; read back from what each wrote."""

import glob
import struct

import pytest

from rlsys.observability.tracking import Trackers, TrackingError, check_backends_installed, flatten, numeric_metrics

CONFIG = {"trainer": {"lr": 0.001, "betas": [0.9, 0.999]}, "model": {"path": "/models/tiny"}}
ROWS = [{"step": step, "reward_mean": 0.25 * step, "loss": 1.0 - step, "timestamp": 1.8e9 + step,
         "weight_version": step, "eval_reward_mean": None, "note": "text"} for step in range(3)]


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    trackers = Trackers(["tensorboard", "wandb", "mlflow"], run_dir, CONFIG, "rlsys-tests", "run-a")
    for row in ROWS:
        trackers.log(row)
    trackers.close()
    return run_dir


def test_only_finite_numbers_are_metrics():
    row = {"step": 3, "timestamp": 1.0, "loss": 0.5, "ok": True, "nan": float("nan"), "name": "x", "n": 4}
    assert numeric_metrics(row) == {"loss": 0.5, "n": 4.0}
    assert flatten(CONFIG) == {"trainer.lr": 0.001, "trainer.betas": [0.9, 0.999], "model.path": "/models/tiny"}


def test_tensorboard_event_files_hold_every_step(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tracked / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["loss", "reward_mean", "weight_version"]
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [(0, 0.0), (1, 0.25), (2, 0.5)]
    assert "config" in " ".join(events.Tags()["tensors"])  # the config, as text


def _wandb_records(path):
    """The protobuf records of a .wandb file (a LevelDB-style log: 32 KiB blocks of chunks with a
    7-byte header, after a 7-byte file header)."""
    from wandb.proto import wandb_internal_pb2

    data, block, position, pending = open(path, "rb").read(), 32768, 7, b""
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:
            position += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if kind == 0:
            position += left
            continue
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_wandb_runs_offline_in_the_run_directory(tracked):
    import json

    [path] = glob.glob(str(tracked / "wandb" / "offline-run-*" / "run-*.wandb"))
    records = list(_wandb_records(path))
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in records
               if r.WhichOneof("record_type") == "history"]
    # (a CI run on 2026-12-05 read no history here, not reproduced in 25 runs since: if again, what the
    # file held and wandb's own log say why)
    seen = [r.WhichOneof("record_type") for r in records]
    internal = sorted(glob.glob(str(tracked / "wandb" / "offline-run-*" / "logs" / "debug-internal.log")))
    assert [(h["_step"], h["reward_mean"], h["loss"]) for h in history] == [
        (0, 0.0, 1.0), (1, 0.25, 0.0), (2, 0.5, -1.0)], (seen, open(internal[-1]).read()[-3000:] if internal else "")
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in run.config.update}
    assert config["trainer"]["lr"] == 0.001 and run.display_name == "run-a"


def test_mlflow_file_store_holds_params_and_metric_history(tracked):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(tracked / "mlruns").as_uri())
    [run] = client.search_runs([client.get_experiment_by_name("rlsys-tests").experiment_id])
    assert run.info.run_name == "run-a" and run.info.status == "FINISHED"
    assert run.data.params["trainer.lr"] == "0.001" and run.data.params["model.path"] == "/models/tiny"
    history = client.get_metric_history(run.info.run_id, "reward_mean")
    assert sorted((m.step, m.value) for m in history) == [(0, 0.0), (1, 0.25), (2, 0.5)]


def test_a_missing_backend_package_names_its_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(TrackingError, match=r"'wandb' but its package is not installed: pip install 'rlsys\[wandb\]'"):
        check_backends_installed(["tensorboard", "wandb"])


def _tensorboard_points(log_dir, tag="reward_mean"):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)], events.Tags()["tensors"]


def test_steps_run_again_replace_their_first_values_in_tensorboard(tmp_path):
    """A recovery in the same process (a trainer node lost: back to the step-2 checkpoint), then a
    `--resume` in a new process from the step-1 checkpoint: TensorBoard shows each step once, with the
    values of the run that went on, as metrics.jsonl does."""
    first = Trackers(["tensorboard"], tmp_path, CONFIG, "rlsys-tests", "run-a")
    first.rewind(0)  # the run's start
    for step in range(4):
        first.log({"step": step, "reward_mean": float(step)})
    first.rewind(2)  # steps 2 and 3 run again
    for step in range(2, 5):
        first.log({"step": step, "reward_mean": 10.0 + step})
    first.close()
    points, tensors = _tensorboard_points(tmp_path / "tensorboard")
    assert points == [(0, 0.0), (1, 1.0), (2, 12.0), (3, 13.0), (4, 14.0)]
    assert "config" in " ".join(tensors)

    resumed = Trackers(["tensorboard"], tmp_path, CONFIG, "rlsys-tests", "run-a")
    resumed.rewind(1)
    resumed.log({"step": 1, "reward_mean": 21.0})
    resumed.close()
    points, tensors = _tensorboard_points(tmp_path / "tensorboard")
    assert points == [(0, 0.0), (1, 21.0)]
    assert "config" in " ".join(tensors)  # logged at step 0, before any step that ran again


def test_mlflow_keeps_both_values_of_a_step_run_again_the_later_one_last(tmp_path):
    """MLflow cannot delete a logged point: the step's history has both values, the run's own last."""
    from mlflow.tracking import MlflowClient

    trackers = Trackers(["mlflow"], tmp_path, CONFIG, "rlsys-tests", "run-a")
    trackers.rewind(0)
    trackers.log({"step": 0, "reward_mean": 0.0})
    trackers.log({"step": 1, "reward_mean": 1.0})
    trackers.rewind(1)
    trackers.log({"step": 1, "reward_mean": 11.0})
    trackers.close()
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    [run] = client.search_runs([client.get_experiment_by_name("rlsys-tests").experiment_id])
    history = sorted(client.get_metric_history(run.info.run_id, "reward_mean"), key=lambda m: (m.step, m.timestamp))
    assert [(m.step, m.value) for m in history] == [(0, 0.0), (1, 1.0), (1, 11.0)]
