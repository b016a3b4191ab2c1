"""metrics.jsonl: one row per step, valid JSON even for NaN, and rows of replayed steps replaced."""

import json
import math

from rlsys.metrics import MetricsLog, read_metrics


def test_rows_are_appended_as_json_with_non_finite_values_as_null(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.append({"step": 0, "loss": 0.5})
    log.append({"step": 1, "loss": math.nan, "kl": math.inf})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"step": 0, "loss": 0.5}, {"step": 1, "loss": None, "kl": None}]
    assert MetricsLog(tmp_path / "metrics.jsonl").rows == log.rows  # a reopened log reads what is there


def test_truncate_drops_the_steps_that_will_run_again(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    for step in range(5):
        log.append({"step": step})
    log.truncate_from(3)
    assert [r["step"] for r in log.rows] == [0, 1, 2]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temporary file left
    log.append({"step": 3})
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3]
