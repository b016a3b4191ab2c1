"""Prompt datasets: a file or a built-in synthetic task, split into train and eval.

A row maps to `PromptRecord(prompt, label, metadata, images)` through `data.prompt_key` (default
"prompt": a string, or a list of chat messages whose parts may hold images,
rlsys/data/conversations.py), `data.label_key` ("label"), `data.metadata_keys` (columns gathered into
metadata; a `metadata` object field is kept too) and `data.image_key` (a vision-language model's
images beside a string prompt: rlsys/multimodal/images.py; unset, a row has none). Formats, by path:
- `.jsonl`: one JSON object per line; a field that is not mapped is an error (a typo, most likely);
- `.parquet` and `.csv`: read with pyarrow (a CSV's values as the strings written: `007` stays `007`);
- `.json`: a JSON array of objects, or JSON lines;
- a directory saved by `datasets` (`save_to_disk`): a Dataset, or a DatasetDict whose split
  `data.train_split` / `data.eval_split` is used.
In table formats, columns that are not mapped are ignored (published datasets carry many). Every
format gets the same row checks, and an error names the file and row (or line); a row that cannot be
read (not UTF-8, not JSON, the wrong number of CSV fields) is one bad row, skipped and counted with
`data.skip_invalid_rows` like any other. The eval split is never trained on: rows whose prompt
(text or messages, and images) appears in eval are removed from train.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from rlsys.config import DataConfig
from rlsys.data.conversations import ConversationError, read_conversation
from rlsys.data.tasks import generate_task
from rlsys.errors import UserError
from rlsys.multimodal.images import ImageError, read_images
from rlsys.records import EncodedPrompt, PromptRecord
from rlsys.rollout.seeds import train_prompt_seed


class DatasetError(UserError):
    """A dataset file or row is malformed; the message names the file, line and reason."""


@dataclass(frozen=True)
class Columns:
    """Which fields of a row hold the prompt, the label and extra metadata."""

    prompt: str = "prompt"
    label: str = "label"
    metadata: tuple[str, ...] = ()
    images: str | None = None

    @classmethod
    def from_config(cls, config: DataConfig) -> Columns:
        return cls(config.prompt_key, config.label_key, tuple(config.metadata_keys), config.image_key)

    @property
    def mapped(self) -> set[str]:
        """The fields a row's record is made of."""
        return {self.prompt, self.label, "metadata", *self.metadata} | ({self.images} if self.images else set())


def parse_row(raw: bytes | str, where: str, columns: Columns = Columns(), base_dir: Path | None = None,
              ) -> PromptRecord:
    """One JSONL line -> a record (JSON, then `record_from_row` with unknown fields refused)."""
    return record_from_row(_json_line(raw, where), where, columns, refuse_unknown=True, base_dir=base_dir)


def _json_line(raw: bytes | str, where: str) -> dict:
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise DatasetError(f"{where}: not valid UTF-8 (byte {error.object[error.start]:#04x} "
                               f"at column {error.start + 1})") from None
    try:
        row = json.loads(raw)
    except json.JSONDecodeError as error:
        raise DatasetError(f"{where}: not valid JSON ({error.msg})") from None
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    return row


def record_from_row(row: dict, where: str, columns: Columns, refuse_unknown: bool,
                    base_dir: Path | None = None) -> PromptRecord:
    """`base_dir`: where an image's relative path starts (the data file's folder)."""
    if refuse_unknown:
        allowed = columns.mapped
        unknown = set(row) - allowed
        if unknown:
            raise DatasetError(f"{where}: unknown field(s) {sorted(unknown)}; allowed: {', '.join(sorted(allowed))} "
                               "(data.prompt_key, data.label_key, data.metadata_keys map others)")
    prompt, messages, images = row.get(columns.prompt), (), ()
    if isinstance(prompt, list):  # chat messages (rlsys/data/conversations.py)
        try:
            messages, images, prompt = read_conversation(prompt, base_dir)
        except ConversationError as error:
            raise DatasetError(f"{where}: {columns.prompt!r}{error}") from None
    elif not isinstance(prompt, str) or not prompt:
        raise DatasetError(f"{where}: {columns.prompt!r} must be a non-empty string or a list of chat messages, "
                           f"got {prompt!r}")
    if columns.label not in row:
        raise DatasetError(f"{where}: missing {columns.label!r}")
    label = row[columns.label]
    if isinstance(label, bool) or not isinstance(label, (str, int, float)):
        raise DatasetError(f"{where}: {columns.label!r} must be a string or a number, got {type(label).__name__}")
    metadata = row.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise DatasetError(f"{where}: 'metadata' must be an object, got {type(metadata).__name__}")
    # A key is a column of the row, or a field of its `metadata` object (where the docs put it).
    missing = [key for key in columns.metadata if key not in row and key not in metadata]
    if missing:
        raise DatasetError(f"{where}: missing metadata field(s) {missing}: neither a column nor in the row's "
                           "metadata object (data.metadata_keys, eval.datasets[].metadata_keys)")
    metadata = {**metadata, **{key: row[key] for key in columns.metadata if key in row}}
    if columns.images is not None and row.get(columns.images) is not None:
        if messages:
            raise DatasetError(f"{where}: {columns.images!r} beside a conversational {columns.prompt!r}: put each "
                               "image in its message as an image part, where the model is to see it")
        try:
            images = read_images(row.get(columns.images), base_dir)
        except ImageError as error:
            raise DatasetError(f"{where}: {columns.images!r}{error}") from None
    return PromptRecord(prompt=prompt, label=str(label), metadata=metadata, images=images, messages=messages)


def read_jsonl(path: str | Path, skip_invalid: bool = False, columns: Columns = Columns(),
               ) -> tuple[list[PromptRecord], int]:
    """Read prompt records; returns (records, number of skipped rows)."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"dataset file {path} does not exist")
    records, skipped = [], 0
    with path.open("rb") as handle:  # decoded line by line, so a bad byte names its line
        for line_number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                records.append(parse_row(raw, f"{path}:{line_number}", columns, path.parent))
            except DatasetError:
                if not skip_invalid:
                    raise
                skipped += 1
    if not records:
        raise DatasetError(f"dataset file {path} has no valid rows")
    return records, skipped


def read_records(path: str | Path, columns: Columns = Columns(), skip_invalid: bool = False,
                 split: str = "train") -> tuple[list[PromptRecord], int]:
    """Records of a dataset in any supported format (see the module docstring); (records, skipped)."""
    path = Path(path)
    if path.is_file() and path.suffix == ".jsonl":
        return read_jsonl(path, skip_invalid, columns)
    records, skipped = [], 0
    for where, row in _table_rows(path, split, columns):
        try:
            if isinstance(row, DatasetError):  # a row that could not even be read
                raise row
            records.append(record_from_row(row, where, columns, refuse_unknown=False,
                                           base_dir=path if path.is_dir() else path.parent))
        except DatasetError:
            if not skip_invalid:
                raise
            skipped += 1
    if not records:
        raise DatasetError(f"dataset {path} has no valid rows")
    return records, skipped


def _table_rows(path: Path, split: str, columns: Columns) -> Iterator[tuple[str, dict | DatasetError]]:
    """(where, row) of a Parquet/JSON/CSV file or a saved `datasets` directory, rows (or lines)
    numbered from 1; a row that cannot be read comes as the DatasetError saying why."""
    if not path.exists():
        raise DatasetError(f"dataset {path} does not exist")
    if path.is_file() and path.suffix in (".json", ".csv") and path.stat().st_size == 0:
        raise DatasetError(f"dataset {path} is empty: no rows")
    if path.is_file() and path.suffix == ".json":
        yield from _json_rows(path, columns)
        return
    if path.is_file() and path.suffix == ".parquet":
        parquet = _import("pyarrow.parquet", "Parquet")
        try:
            table = parquet.read_table(path)
        except Exception as error:  # noqa: BLE001 - pyarrow's reasons (ArrowInvalid, OSError) name the damage
            raise DatasetError(f"dataset {path}: cannot be read as Parquet: {error}") from None
    elif path.is_file() and path.suffix == ".csv":
        table, bad_lines = _csv_table(path)
        yield from bad_lines
    elif path.is_dir():
        table = _saved_dataset(path, split)
    else:
        raise DatasetError(f"dataset {path}: unsupported format (use .jsonl, .parquet, .json, .csv, or a "
                           "directory written by datasets' save_to_disk)")
    yield from _arrow_rows(table, path, columns)


def _json_rows(path: Path, columns: Columns) -> Iterator[tuple[str, dict | DatasetError]]:
    """A JSON array of objects (rows numbered), or JSON lines (named by line, like .jsonl); a bad
    byte counts only in a mapped field, as in the other table formats."""
    wanted = columns.mapped
    raw = path.read_bytes()
    if not raw.strip():
        raise DatasetError(f"dataset {path}: cannot be read: it holds only whitespace, no JSON")
    if raw.lstrip().startswith(b"["):
        # Bytes that are not UTF-8 are kept as lone surrogates, so the row holding them is found below.
        try:
            rows = json.loads(raw.decode("utf-8", errors="surrogateescape"))
        except json.JSONDecodeError as error:
            raise DatasetError(f"{path}:{error.lineno}: not valid JSON ({error.msg}; the file is one JSON "
                               "array, so no row of it can be skipped)") from None
        for index, row in enumerate(rows, start=1):
            where = f"{path}:row {index}"
            if not isinstance(row, dict):
                yield where, DatasetError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
                continue
            bad = next(((key, byte) for key, value in row.items()
                        if key in wanted and (byte := _undecoded_byte(value)) is not None), None)
            yield where, (DatasetError(f"{where}: not valid UTF-8 (byte {bad[1]:#04x} in field {bad[0]!r})")
                          if bad else row)
        return
    for line_number, line in enumerate(raw.split(b"\n"), start=1):
        if line.strip():
            where = f"{path}:{line_number}"
            try:
                yield where, _json_line(line, where)
            except DatasetError as error:
                yield where, error


def _undecoded_byte(value) -> int | None:
    """The first byte that `surrogateescape` kept undecoded in a JSON value, or None."""
    if isinstance(value, str):
        return next((ord(char) - 0xDC00 for char in value if 0xDC80 <= ord(char) <= 0xDCFF), None)
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return next((byte for item in items if (byte := _undecoded_byte(item)) is not None), None)


def _csv_header(path: Path) -> list[str]:
    """The CSV's column names (its first record, quoting as the csv module reads it)."""
    import csv as csv_module

    with path.open(newline="", encoding="utf-8", errors="replace") as file:
        return next(csv_module.reader(file), [])


def _csv_table(path: Path):
    """The CSV as an Arrow table of strings, and (where, DatasetError) of each line with the wrong
    number of fields, which pyarrow leaves out of the table. Strings, not inferred types: a CSV says
    nothing of types, and inferring them turned a label `007` into `7` and metadata "006" into 6."""
    import pyarrow

    csv = _import("pyarrow.csv", "CSV")
    bad_lines = []
    as_written = {name: pyarrow.string() for name in _csv_header(path)}

    def wrong_field_count(row) -> str:
        where = f"{path}:{row.number}"
        bad_lines.append((where, DatasetError(f"{where}: {row.actual_columns} fields, the header has "
                                              f"{row.expected_columns}")))
        return "skip"

    try:  # one thread: pyarrow then knows each bad line's number; strings are checked row by row below
        table = csv.read_csv(path, read_options=csv.ReadOptions(use_threads=False),
                             parse_options=csv.ParseOptions(invalid_row_handler=wrong_field_count),
                             convert_options=csv.ConvertOptions(check_utf8=False, column_types=as_written,
                                                                strings_can_be_null=False))
    except Exception as error:  # noqa: BLE001 - pyarrow's ArrowInvalid names the problem
        raise DatasetError(f"dataset {path}: cannot be read as CSV: {error}") from None
    return table, bad_lines


def _arrow_rows(table, path: Path, columns: Columns) -> Iterator[tuple[str, dict | DatasetError]]:
    """Rows of an Arrow table as dicts, only the mapped columns (a bad byte elsewhere is no matter)."""
    wanted = columns.mapped
    table = table.select([name for name in table.column_names if name in wanted])
    index = 0
    for batch in table.to_batches():
        try:
            rows = batch.to_pylist()
        except UnicodeDecodeError:  # a string that is not UTF-8 (a CSV read unchecked): find its row
            rows = [_arrow_row(batch, i) for i in range(batch.num_rows)]
        for row in rows:
            index += 1
            where = f"{path}:row {index}"
            yield where, row if isinstance(row, dict) else DatasetError(f"{where}: {row}")


def _arrow_row(batch, i: int) -> dict | str:
    """Row `i` of a record batch, or why it cannot be read."""
    row = {}
    for name, column in zip(batch.schema.names, batch.columns, strict=True):
        try:
            row[name] = column[i].as_py()
        except UnicodeDecodeError as error:
            return f"not valid UTF-8 (byte {error.object[error.start]:#04x} in column {name!r})"
    return row


def _saved_dataset(path: Path, split: str):
    datasets = _import("datasets", "saved Hugging Face datasets")
    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError:
        raise DatasetError(f"dataset {path}: a directory must be one written by datasets' save_to_disk") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DatasetError(f"dataset {path} has the splits {sorted(loaded)}, not {split!r} "
                               "(data.train_split / data.eval_split)")
        loaded = loaded[split]
    return loaded.with_format("arrow")[:]  # an Arrow table, read as every other table format


def _import(module: str, what: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise DatasetError(f"reading {what} needs the 'data' extra: pip install 'rlsys[data]'") from None


@dataclass
class PromptSplits:
    train: list[PromptRecord]
    eval: list[PromptRecord]
    skipped_rows: int = 0


def _asked(record: PromptRecord) -> tuple:
    """What a prompt asks, to tell eval prompts in train: its text or its whole conversation, and its
    images (a vision-language task's prompts are often one text, "color?", told apart by the image)."""
    import hashlib

    text = json.dumps(record.messages, sort_keys=True) if record.messages else record.prompt
    return text, tuple(hashlib.sha256(image).hexdigest() for image in record.images)


def load_splits(config: DataConfig, seed: int) -> PromptSplits:
    if config.synthetic is not None:
        train, eval_ = ([PromptRecord(e.prompt, e.label, {"task": e.task}, e.images) for e in split]
                        for split in generate_task(config.synthetic))
        return PromptSplits(train=train, eval=eval_)
    columns = Columns.from_config(config)
    train, skipped = read_records(config.train_path, columns, config.skip_invalid_rows, config.train_split)
    if config.eval_path:
        eval_, skipped_eval = read_records(config.eval_path, columns, config.skip_invalid_rows, config.eval_split)
        skipped += skipped_eval
    elif config.eval_fraction > 0:
        shuffled = list(train)
        random.Random(seed).shuffle(shuffled)
        n_eval = max(1, int(len(shuffled) * config.eval_fraction))
        eval_, train = shuffled[:n_eval], shuffled[n_eval:]
    else:
        eval_ = []
    eval_prompts = {_asked(record) for record in eval_}
    train = [record for record in train if _asked(record) not in eval_prompts]
    if not train:
        raise DatasetError("no training prompts are left after removing those in the eval split")
    return PromptSplits(train=train, eval=eval_, skipped_rows=skipped)


class PromptSampler:
    """Deterministic epoch-shuffled batches; its position is the (epoch, index) pair."""

    def __init__(self, records: list[EncodedPrompt], batch_size: int, seed: int):
        self.records = records
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.index = 0
        self._order = self._shuffled_order()

    def _shuffled_order(self) -> list[int]:
        order = list(range(len(self.records)))
        random.Random(self.seed * 100_003 + self.epoch).shuffle(order)
        return order

    def restore(self, epoch: int, index: int) -> None:
        """Continue from a saved position: the same prompts come next, none replayed or skipped."""
        self.epoch, self.index = epoch, index
        self._order = self._shuffled_order()

    def next_batch(self) -> list[EncodedPrompt]:
        return self.next_prompts(self.batch_size)

    def next_prompts(self, count: int) -> list[EncodedPrompt]:
        """The next `count` prompts (partial rollouts draw only what their groups in flight lack)."""
        batch = []
        while len(batch) < count:
            if self.index >= len(self._order):
                self.epoch += 1
                self.index = 0
                self._order = self._shuffled_order()
            # each draw with its own sampling seed, from where it stands (restored on resume)
            batch.append(replace(self.records[self._order[self.index]],
                                 seed=train_prompt_seed(self.seed, self.epoch, self.index)))
            self.index += 1
        return batch


def repeated_prompts_note(prompts_per_step: int, num_train: int) -> str | None:
    """What to say at start when a step draws more prompts than the train split holds (each step
    then goes round the data more than once: some prompts are trained on several times per step)."""
    if prompts_per_step <= num_train:
        return None
    return (f"data.prompts_per_step ({prompts_per_step}) is more than the {num_train} train prompts: each step "
            f"trains each prompt {prompts_per_step / num_train:.1f} times on average (lower data.prompts_per_step "
            f"to at most {num_train} to see each prompt at most once per step)")
