"""data.train_path in every supported format, with column mapping and the same row checks."""

import json

import pytest

from rlsys.config import DataConfig
from rlsys.data import Columns, DatasetError, PromptRecord, load_splits, read_records

ROWS = [
    {"question": "2+2?", "answer": 4, "source": "gsm8k", "level": 1, "unused": "x"},
    {"question": "3*3?", "answer": 9, "source": "math", "level": 2, "unused": "y"},
]
COLUMNS = Columns(prompt="question", label="answer", metadata=("source", "level"))
EXPECTED = [PromptRecord("2+2?", "4", {"source": "gsm8k", "level": 1}),
            PromptRecord("3*3?", "9", {"source": "math", "level": 2})]


def _parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_parquet_rows_map_through_the_configured_columns(tmp_path):
    records, skipped = read_records(_parquet(tmp_path / "d.parquet", ROWS), COLUMNS)
    assert records == EXPECTED and skipped == 0


def test_json_and_csv_files_load_through_datasets(tmp_path):
    (tmp_path / "d.json").write_text("\n".join(json.dumps(row) for row in ROWS))
    assert read_records(tmp_path / "d.json", COLUMNS)[0] == EXPECTED
    (tmp_path / "d.csv").write_text("question,answer,source,level\n2+2?,4,gsm8k,1\n3*3?,9,math,2\n")
    assert read_records(tmp_path / "d.csv", COLUMNS)[0] == EXPECTED


def test_a_saved_dataset_and_a_dataset_dict_split(tmp_path):
    import datasets

    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "one"))
    assert read_records(tmp_path / "one", COLUMNS)[0] == EXPECTED
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:1]),
                          "test": datasets.Dataset.from_list(ROWS[1:])}).save_to_disk(str(tmp_path / "dict"))
    config = DataConfig(train_path=str(tmp_path / "dict"), eval_path=str(tmp_path / "dict"), prompt_key="question",
                        label_key="answer", metadata_keys=["source", "level"])
    splits = load_splits(config, seed=0)
    assert splits.train == EXPECTED[:1] and splits.eval == EXPECTED[1:]
    with pytest.raises(DatasetError, match=r"splits \['test', 'train'\], not 'validation'"):
        read_records(tmp_path / "dict", COLUMNS, split="validation")


def test_bad_rows_name_their_file_and_row_and_can_be_skipped(tmp_path):
    rows = [ROWS[0], {**ROWS[1], "question": ""}, {**ROWS[0], "answer": None}]
    path = _parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(DatasetError, match=r"bad\.parquet:row 2: 'question' must be a non-empty string"):
        read_records(path, COLUMNS)
    records, skipped = read_records(path, COLUMNS, skip_invalid=True)
    assert records == EXPECTED[:1] and skipped == 2
    with pytest.raises(DatasetError, match=r"row 1: missing metadata column\(s\) \['grade'\]"):
        read_records(path, Columns("question", "answer", ("grade",)))


def test_jsonl_keeps_refusing_unknown_fields_but_accepts_mapped_ones(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"question": "2+2?", "answer": 4, "source": "gsm8k", "level": 1}) + "\n")
    assert read_records(path, Columns("question", "answer", ("source", "level")))[0] == EXPECTED[:1]
    with pytest.raises(DatasetError, match=r"unknown field\(s\) \['level'\]"):
        read_records(path, Columns("question", "answer", ("source",)))


def test_unsupported_or_missing_datasets_are_named(tmp_path):
    (tmp_path / "d.txt").write_text("hello")
    with pytest.raises(DatasetError, match="unsupported format"):
        read_records(tmp_path / "d.txt")
    with pytest.raises(DatasetError, match="does not exist"):
        read_records(tmp_path / "missing.parquet")
    (tmp_path / "plain_dir").mkdir()
    with pytest.raises(DatasetError, match="written by datasets' save_to_disk"):
        read_records(tmp_path / "plain_dir")
