"""A checkpoint carries the metrics row and shown samples of the step it closes, so a run killed
between the checkpoint and their append (a window CI's kill-after-checkpoint test once hit: step 1's
row was gone after the resume, and step 1 never runs again) gets them back when it resumes."""

import json

from rlsys.observability.metrics import MetricsLog, read_metrics
from rlsys.observability.samples import SamplesLog
from rlsys.observability.tracking import Trackers
from rlsys.run.checkpointing import CheckpointStore, CoordinatorState, StepRecord
from rlsys.run.run_state import log_the_step_it_closes


def _row(step: int) -> dict:
    return {"step": step, "reward_mean": 0.25 * step, "loss": -0.5 + step, "time_train_s": 0.1}


def _samples(step: int) -> list[dict]:
    return [{"step": step, "source": "train", "prompt": f"p{step}", "response": "r", "reward": 1.0,
             "finish_reason": "stop", "response_tokens": 1}]


def _checkpoint_after(run_dir, finished_steps: int, record: StepRecord | None):
    state = CoordinatorState(next_step=finished_steps, weight_version=finished_steps, data_epoch=0, data_index=8)
    return CheckpointStore(run_dir).save(finished_steps, lambda directory: None, state, record)


def _logs(run_dir, steps: range):
    log, samples = MetricsLog(run_dir / "metrics.jsonl"), SamplesLog(run_dir / "samples.jsonl")
    for step in steps:
        log.append(_row(step))
        samples.append(_samples(step))
    return log, samples


def test_a_step_killed_after_its_checkpoint_is_logged_from_it_once(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    checkpoint = _checkpoint_after(tmp_path, 2, StepRecord(_row(1), _samples(1)))
    assert json.loads((checkpoint / "step_record.json").read_text())["row"] == _row(1)
    log, samples = _logs(tmp_path, range(1))  # killed before step 1's append
    trackers = Trackers(["tensorboard"], tmp_path, {}, "rlsys-tests", "record")
    trackers.rewind(2)
    log_the_step_it_closes(checkpoint, 2, log, samples, trackers)
    log_the_step_it_closes(checkpoint, 2, log, samples, trackers)  # a second resume adds nothing
    trackers.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == [_row(0), _row(1)] == log.rows
    assert [row["prompt"] for row in samples.latest(10)] == ["p0", "p1"]
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [(event.step, event.value) for event in events.Scalars("reward_mean")] == [(1, 0.25)]


def test_only_what_the_logs_lack_is_logged_from_the_checkpoint(tmp_path):
    checkpoint = _checkpoint_after(tmp_path, 2, StepRecord(_row(1), _samples(1)))
    log, samples = _logs(tmp_path, range(1))
    log.append(_row(1))  # killed between the row's append and the samples'
    log_the_step_it_closes(checkpoint, 2, log, samples, Trackers([], tmp_path, {}, "", ""))
    assert read_metrics(tmp_path / "metrics.jsonl") == [_row(0), _row(1)]
    assert [row["prompt"] for row in samples.latest(10)] == ["p0", "p1"]


def test_a_checkpoint_without_a_record_or_of_another_step_logs_nothing(tmp_path):
    for record in (None, StepRecord(_row(0), _samples(0))):  # a stop's checkpoint; a record not of step 1
        run_dir = tmp_path / str(record is None)
        checkpoint = _checkpoint_after(run_dir, 2, record)
        log, samples = _logs(run_dir, range(1))
        log_the_step_it_closes(checkpoint, 2, log, samples, Trackers([], run_dir, {}, "", ""))
        assert read_metrics(run_dir / "metrics.jsonl") == [_row(0)]
        assert CheckpointStore.load_step_record(checkpoint) == record
