"""The model's answers, shown (rlsys/observability/samples.py): which are kept, the run directory's
samples.jsonl across a resume, the status API's /api/v1/samples and the trackers' tables."""

import json

from fastapi.testclient import TestClient

from rlsys.observability.samples import SHOWN_CHARS, SHOWN_IN_STATUS, SamplesLog, markdown_table, shown_samples
from rlsys.observability.status.server import SamplesResponse, build_app
from rlsys.observability.status.state import RunStatus


def _step(step: int, groups: int = 3, group_size: int = 2) -> list[dict]:
    count = groups * group_size
    return shown_samples(step, "train", [f"p{i // group_size}" for i in range(count)], [f"r{i}" for i in range(count)],
                         [i / 10 for i in range(count)], ["stop"] * count, [1] * count, group_size, count=2)


def test_the_first_answer_of_each_of_the_first_prompts_is_kept_each_text_cut():
    rows = _step(4)
    assert [(r["prompt"], r["response"], r["reward"]) for r in rows] == [("p0", "r0", 0.0), ("p1", "r2", 0.2)]
    assert rows[0] == {"step": 4, "source": "train", "prompt": "p0", "response": "r0", "reward": 0.0,
                       "finish_reason": "stop", "response_tokens": 1}
    long = shown_samples(0, "eval", ["p"], ["x" * (SHOWN_CHARS + 5)], [None], ["length"], [9], 1, count=4)
    assert long[0]["response"] == "x" * SHOWN_CHARS + "… (5 more characters)" and long[0]["reward"] is None
    assert shown_samples(0, "train", ["p"], ["r"], [1.0], ["stop"], [1], 1, count=0) == []
    assert "a \\| b" in markdown_table([{**rows[0], "response": "a | b"}])  # a cell's pipe is no column


def test_a_resumed_run_drops_the_samples_of_the_steps_it_runs_again(tmp_path):
    log = SamplesLog(tmp_path / "samples.jsonl")
    for step in range(5):
        log.append(_step(step))
    with (tmp_path / "samples.jsonl").open("a") as file:
        file.write('{"step": 5, "sour')  # a killed run's last line, cut off
    log.truncate_from(3)
    kept = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert sorted({row["step"] for row in kept}) == [0, 1, 2]
    assert [row["step"] for row in log.latest(3)] == [1, 2, 2]


def test_the_status_api_serves_the_latest_samples_and_a_finished_run_reads_them_back(tmp_path):
    status = RunStatus(run_id="r", total_steps=100, run_dir=str(tmp_path))
    log = SamplesLog(tmp_path / "samples.jsonl")
    for step in range(30):
        log.append(_step(step))
        status.record_samples(_step(step))
    body = SamplesResponse.model_validate(TestClient(build_app(status, token=None)).get("/api/v1/samples").json())
    assert len(body.samples) == SHOWN_IN_STATUS and body.samples[-1].step == 29
    status.save_snapshot()
    finished = RunStatus.from_run_dir(tmp_path)  # `rlsys serve` of a run that is over
    assert [row["step"] for row in finished.latest_samples()] == [row.step for row in body.samples]


def test_the_trackers_get_each_steps_samples_as_a_table(tmp_path):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rlsys.observability.tracking import Trackers

    trackers = Trackers(["tensorboard", "wandb", "mlflow"], tmp_path, {"seed": 0}, "rlsys-tests", "samples")
    for step in range(2):
        trackers.log({"step": step, "reward_mean": 0.5})
        trackers.log_samples(step, _step(step))
    trackers.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    texts = [event for event in events.Tensors("samples/text_summary")]
    assert [event.step for event in texts] == [0, 1]
    assert "| p1 | r2 | 0.2 | stop |" in texts[1].tensor_proto.string_val[0].decode()
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    [run] = client.search_runs([client.get_experiment_by_name("rlsys-tests").experiment_id])
    artifacts = sorted(a.path for a in client.list_artifacts(run.info.run_id, "samples"))
    assert artifacts == ["samples/step_00000000.jsonl", "samples/step_00000001.jsonl"]
    assert list((tmp_path / "wandb").glob("offline-run-*/files/media/table/samples_*.table.json"))
