"""data.train_path in every supported format, with column mapping and the same row checks."""

import json

import pytest

from rlsys.config import DataConfig
from rlsys.data.datasets import Columns, DatasetError, load_splits, read_records
from rlsys.records import PromptRecord

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
    # A CSV declares no types: its values are the strings written (the level too)
    assert read_records(tmp_path / "d.csv", COLUMNS)[0] == [
        PromptRecord(r.prompt, r.label, {**r.metadata, "level": str(r.metadata["level"])}) for r in EXPECTED]


def test_every_format_keeps_values_as_the_file_writes_them(tmp_path):
    """A label `007` stays "007" and metadata "006" stays "006" (CSV used to guess 7 and 6); where a
    format declares a type (JSON numbers, Parquet columns) that type is kept."""
    columns = Columns(prompt="question", label="answer", metadata=("code", "n"))
    (tmp_path / "d.csv").write_text('question,answer,code,n\n"a, b",007,"006",\n')
    assert read_records(tmp_path / "d.csv", columns)[0] == [PromptRecord("a, b", "007", {"code": "006", "n": ""})]
    (tmp_path / "d.jsonl").write_text(json.dumps({"question": "a, b", "answer": "007", "code": "006", "n": 5}) + "\n")
    assert read_records(tmp_path / "d.jsonl", columns)[0] == [PromptRecord("a, b", "007", {"code": "006", "n": 5})]
    rows = [{"question": "a, b", "answer": "007", "code": "006", "n": 5}]
    assert read_records(_parquet(tmp_path / "d.parquet", rows), columns)[0] == \
        [PromptRecord("a, b", "007", {"code": "006", "n": 5})]


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
    with pytest.raises(DatasetError, match=r"row 1: missing metadata field\(s\) \['grade'\]: neither a column nor "):
        read_records(path, Columns("question", "answer", ("grade",)))


def test_a_metadata_key_may_live_in_the_rows_metadata_object(tmp_path):
    """data.metadata_keys named fields of a row's nested `metadata` object (as the docs show them)
    and were refused as missing columns."""
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"question": "2+2?", "answer": 4, "metadata": {"grade": 3, "source": "x"}}) + "\n"
                    + json.dumps({"question": "3+3?", "answer": 6, "grade": 5}) + "\n")
    records, _ = read_records(path, Columns("question", "answer", ("grade",)))
    assert [r.metadata for r in records] == [{"grade": 3, "source": "x"}, {"grade": 5}]


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


@pytest.mark.parametrize("suffix", [".json", ".csv"])
def test_an_empty_table_file_is_called_empty(tmp_path, suffix):
    (tmp_path / f"d{suffix}").write_text("")
    with pytest.raises(DatasetError, match=f"dataset {tmp_path / ('d' + suffix)} is empty: no rows$"):
        read_records(tmp_path / f"d{suffix}", COLUMNS)


def test_a_table_file_the_loader_refuses_gives_a_reason(tmp_path):
    (tmp_path / "d.json").write_text("  \n")  # not empty, yet no JSON in it
    with pytest.raises(DatasetError, match=r"cannot be read: \S") as error:
        read_records(tmp_path / "d.json", COLUMNS)
    assert not str(error.value).endswith(": ")


def _rows_with_a_bad_byte(path):
    """Three rows, the second's prompt holding the byte 0xe9 (Latin-1 "é"), which is not UTF-8, in
    the format `path` names. Arrow writes no such string itself; a binary column viewed as text
    stands in for a file another tool wrote."""
    import pyarrow as pa

    prompts = [b"2+2?", b"caf\xe9?", b"3*3?"]
    if path.suffix in (".jsonl", ".json") and "array" not in path.name:
        path.write_bytes(b"".join(b'{"question": "%s", "answer": %d}\n' % (p, i) for i, p in enumerate(prompts)))
    elif path.suffix == ".json":
        path.write_bytes(b"[" + b", ".join(b'{"question": "%s", "answer": %d}' % (p, i)
                                           for i, p in enumerate(prompts)) + b"]")
    elif path.suffix == ".csv":
        path.write_bytes(b"question,answer\n" + b"".join(b"%s,%d\n" % (p, i) for i, p in enumerate(prompts)))
    else:
        table = pa.table({"question": pa.array(prompts, pa.binary()).view(pa.string()), "answer": [0, 1, 2]})
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            pq.write_table(table, path)
        else:
            import datasets

            datasets.Dataset(table).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("name, where", [
    ("d.jsonl", r"d\.jsonl:2: not valid UTF-8 \(byte 0xe9 at column 18\)"),
    ("lines.json", r"lines\.json:2: not valid UTF-8 \(byte 0xe9 at column 18\)"),
    ("array.json", r"array\.json:row 2: not valid UTF-8 \(byte 0xe9 in field 'question'\)"),
    ("d.csv", r"d\.csv:row 2: not valid UTF-8 \(byte 0xe9 in column 'question'\)"),
    ("d.parquet", r"d\.parquet:row 2: not valid UTF-8 \(byte 0xe9 in column 'question'\)"),
    ("saved", r"saved:row 2: not valid UTF-8 \(byte 0xe9 in column 'question'\)"),
])
def test_a_row_that_is_not_utf8_is_named_or_skipped_and_counted_in_every_format(tmp_path, name, where):
    path = _rows_with_a_bad_byte(tmp_path / name)
    columns = Columns(prompt="question", label="answer")
    with pytest.raises(DatasetError, match=where):
        read_records(path, columns)
    config = DataConfig(train_path=str(path), prompt_key="question", label_key="answer", skip_invalid_rows=True)
    splits = load_splits(config, seed=0)
    assert [(r.prompt, r.label) for r in splits.train] == [("2+2?", "0"), ("3*3?", "2")]
    assert splits.skipped_rows == 1


def test_csv_lines_with_the_wrong_field_count_and_bad_json_lines_are_rows_to_skip(tmp_path):
    columns = Columns(prompt="question", label="answer")
    (tmp_path / "d.csv").write_text("question,answer\n2+2?,4\n3*3?,9,extra\n1+1?,2\n")
    with pytest.raises(DatasetError, match=r"d\.csv:3: 3 fields, the header has 2"):
        read_records(tmp_path / "d.csv", columns)
    records, skipped = read_records(tmp_path / "d.csv", columns, skip_invalid=True)
    assert [r.prompt for r in records] == ["2+2?", "1+1?"] and skipped == 1
    (tmp_path / "d.json").write_text('{"question": "2+2?", "answer": 4}\n{"question": \n{"question": "b", "answer": 1}\n')
    with pytest.raises(DatasetError, match=r"d\.json:2: not valid JSON"):
        read_records(tmp_path / "d.json", columns)
    records, skipped = read_records(tmp_path / "d.json", columns, skip_invalid=True)
    assert [r.prompt for r in records] == ["2+2?", "b"] and skipped == 1
