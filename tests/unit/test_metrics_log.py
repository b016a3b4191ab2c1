"""metrics.jsonl: one JSON row per append, non-finite floats written as null, rows read back by a
new log, and truncation on resume that rewrites the file atomically."""

from __future__ import annotations

import errno
import json
import math
import re
from pathlib import Path

import pytest

from rlsys.observability.metrics import MetricsFileError, MetricsLog, read_metrics
from tests.helpers import fill_disk


def _lines(path: Path) -> list[dict]:
    text = path.read_text()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def test_append_writes_one_json_row_per_call(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    assert log.rows == [] and not path.exists()
    log.append({"step": 0, "loss": 1.5, "phase": "train"})
    assert _lines(path) == [{"step": 0, "loss": 1.5, "phase": "train"}]
    log.append({"step": 1, "loss": 1.25, "tokens": 12})
    assert _lines(path) == [{"step": 0, "loss": 1.5, "phase": "train"}, {"step": 1, "loss": 1.25, "tokens": 12}]
    assert log.rows == _lines(path)


def test_non_finite_floats_are_written_as_null(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    log.append({"step": 0, "nan": math.nan, "inf": math.inf, "ninf": -math.inf, "ok": 0.5, "zero": 0.0})
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    row = json.loads(text)
    assert row == {"step": 0, "nan": None, "inf": None, "ninf": None, "ok": 0.5, "zero": 0.0}
    assert log.rows == [row]


def test_append_does_not_change_the_callers_dict(tmp_path):
    row = {"step": 0, "loss": math.nan}
    MetricsLog(tmp_path / "metrics.jsonl").append(row)
    assert math.isnan(row["loss"])


def test_a_new_log_over_an_existing_file_reads_its_rows_and_keeps_appending(tmp_path):
    path = tmp_path / "metrics.jsonl"
    first = MetricsLog(path)
    first.append({"step": 0, "loss": 2.0})
    first.append({"step": 1, "loss": math.inf})
    second = MetricsLog(path)
    assert second.rows == [{"step": 0, "loss": 2.0}, {"step": 1, "loss": None}]
    second.append({"step": 2, "loss": 1.0})
    assert _lines(path) == [{"step": 0, "loss": 2.0}, {"step": 1, "loss": None}, {"step": 2, "loss": 1.0}]


def test_a_new_log_skips_blank_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n\n{"step": 1}\n   \n')
    assert MetricsLog(path).rows == [{"step": 0}, {"step": 1}]


def test_truncate_from_keeps_only_earlier_steps_in_memory_and_on_disk(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    for step in range(6):
        log.append({"step": step, "loss": float(step)})
    log.truncate_from(3)
    expected = [{"step": 0, "loss": 0.0}, {"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0}]
    assert log.rows == expected
    assert _lines(path) == expected
    assert MetricsLog(path).rows == expected


def test_truncate_from_leaves_no_temporary_file_behind(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    for step in range(4):
        log.append({"step": step})
    log.truncate_from(2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_appending_after_a_truncation_continues_the_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    for step in range(4):
        log.append({"step": step})
    log.truncate_from(2)
    log.append({"step": 2, "rerun": True})
    assert _lines(path) == [{"step": 0}, {"step": 1}, {"step": 2, "rerun": True}]
    assert log.rows == _lines(path)


def test_truncate_from_step_zero_empties_the_log(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    log.append({"step": 0})
    log.append({"step": 1})
    log.truncate_from(0)
    assert log.rows == [] and path.read_text() == ""


def test_truncate_from_beyond_the_last_step_keeps_everything(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    log.append({"step": 0, "x": None})
    log.append({"step": 1, "x": 1})
    log.truncate_from(10)
    assert log.rows == [{"step": 0, "x": None}, {"step": 1, "x": 1}] == _lines(path)


def test_truncate_from_without_a_file_does_nothing(tmp_path):
    path = tmp_path / "metrics.jsonl"
    MetricsLog(path).truncate_from(3)
    assert list(tmp_path.iterdir()) == []


def _torn(path: Path, rows: int) -> None:
    """`rows` whole rows, then the first half of one more: an append a kill or a full disk cut off."""
    whole = "".join(json.dumps({"step": step, "loss": 0.5}) + "\n" for step in range(rows))
    path.write_text(whole + json.dumps({"step": rows, "loss": 0.5})[:9])


def test_a_cut_off_last_line_is_dropped_with_a_warning_naming_it(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    _torn(path, 3)
    assert read_metrics(path) == [{"step": step, "loss": 0.5} for step in range(3)]
    assert f"rlsys: warning: {path}:4: the last line is cut off" in capsys.readouterr().err


def test_any_other_bad_line_names_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    for text, line in [('{"step": 0}\n{"step": 1, "lo\n{"step": 2}\n', 2),  # torn, then appended to
                       ('{"step": 0}\n{"step": 1\n', 2),  # a whole line (it ends) that is not JSON
                       ('{"step": 0}\n[1, 2]\n', 2),  # JSON, but not a row
                       ('\xff{"step": 0}\n{"step": 1}\n', 1)]:
        path.write_text(text, encoding="latin-1")
        with pytest.raises(MetricsFileError, match=f"^{re.escape(str(path))}:{line}: not a JSON object"):
            read_metrics(path)


def test_a_resume_rewrites_a_file_with_a_cut_off_last_line_whole_and_warns_once(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    _torn(path, 5)
    log = MetricsLog(path)
    log.truncate_from(3)  # as a resume from the step-3 checkpoint does
    log.append({"step": 3, "loss": 0.25})
    assert _lines(path) == [{"step": 0, "loss": 0.5}, {"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.5},
                            {"step": 3, "loss": 0.25}]
    assert capsys.readouterr().err.count("the last line is cut off") == 1


def test_an_append_on_a_full_disk_leaves_no_cut_off_line(small_disk):
    path = small_disk / "metrics.jsonl"
    log = MetricsLog(path)
    log.append({"step": 0})
    fill_disk(small_disk)
    # longer than what is left of the file's page: part of it is written before the disk refuses
    with pytest.raises(OSError) as error:
        log.append({"step": 1, "note": "x" * 8192})
    assert error.value.errno == errno.ENOSPC
    assert _lines(path) == [{"step": 0}] == log.rows == MetricsLog(path).rows
