"""Prompt datasets: a file or a built-in synthetic task, split into train and eval.

A row maps to `PromptRecord(prompt, label, metadata)` through `data.prompt_key` (default
"prompt"), `data.label_key` ("label") and `data.metadata_keys` (columns gathered into metadata;
a `metadata` object field is kept too). Formats, by path:
- `.jsonl`: one JSON object per line; a field that is not mapped is an error (a typo, most likely);
- `.parquet`: read with pyarrow; `.json` / `.csv`: loaded with `datasets`;
- a directory saved by `datasets` (`save_to_disk`): a Dataset, or a DatasetDict whose split
  `data.train_split` / `data.eval_split` is used.
In table formats, columns that are not mapped are ignored (published datasets carry many). Every
format gets the same row checks, and an error names the file and row. The eval split is never
trained on: rows whose prompt appears in eval are removed from train.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from rlsys.config import DataConfig
from rlsys.tasks import generate_task


@dataclass(frozen=True)
class PromptRecord:
    prompt: str
    label: str
    metadata: dict = field(default_factory=dict)


class DatasetError(ValueError):
    """A dataset file or row is malformed; the message names the file, line and reason."""


@dataclass(frozen=True)
class Columns:
    """Which fields of a row hold the prompt, the label and extra metadata."""

    prompt: str = "prompt"
    label: str = "label"
    metadata: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, config: DataConfig) -> Columns:
        return cls(config.prompt_key, config.label_key, tuple(config.metadata_keys))


def parse_row(raw: bytes | str, where: str, columns: Columns = Columns()) -> PromptRecord:
    """One JSONL line -> a record (JSON, then `record_from_row` with unknown fields refused)."""
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
    return record_from_row(row, where, columns, refuse_unknown=True)


def record_from_row(row: dict, where: str, columns: Columns, refuse_unknown: bool) -> PromptRecord:
    if refuse_unknown:
        allowed = {columns.prompt, columns.label, "metadata", *columns.metadata}
        unknown = set(row) - allowed
        if unknown:
            raise DatasetError(f"{where}: unknown field(s) {sorted(unknown)}; allowed: {', '.join(sorted(allowed))} "
                               "(data.prompt_key, data.label_key, data.metadata_keys map others)")
    prompt = row.get(columns.prompt)
    if not isinstance(prompt, str) or not prompt:
        raise DatasetError(f"{where}: {columns.prompt!r} must be a non-empty string, got {prompt!r}")
    if columns.label not in row:
        raise DatasetError(f"{where}: missing {columns.label!r}")
    label = row[columns.label]
    if isinstance(label, bool) or not isinstance(label, (str, int, float)):
        raise DatasetError(f"{where}: {columns.label!r} must be a string or a number, got {type(label).__name__}")
    metadata = row.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise DatasetError(f"{where}: 'metadata' must be an object, got {type(metadata).__name__}")
    missing = [key for key in columns.metadata if key not in row]
    if missing:
        raise DatasetError(f"{where}: missing metadata column(s) {missing} (data.metadata_keys)")
    metadata = {**metadata, **{key: row[key] for key in columns.metadata}}
    return PromptRecord(prompt=prompt, label=str(label), metadata=metadata)


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
                records.append(parse_row(raw, f"{path}:{line_number}", columns))
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
    for where, row in _table_rows(path, split):
        try:
            records.append(record_from_row(row, where, columns, refuse_unknown=False))
        except DatasetError:
            if not skip_invalid:
                raise
            skipped += 1
    if not records:
        raise DatasetError(f"dataset {path} has no valid rows")
    return records, skipped


def _table_rows(path: Path, split: str) -> Iterator[tuple[str, dict]]:
    """(where, row) of a Parquet/JSON/CSV file or a saved `datasets` directory, row numbers from 1."""
    if not path.exists():
        raise DatasetError(f"dataset {path} does not exist")
    if path.is_file() and path.suffix == ".parquet":
        table = _import("pyarrow.parquet", "Parquet").read_table(path)
        rows = table.to_pylist()
    elif path.is_file() and path.suffix in (".json", ".csv"):
        datasets = _import("datasets", f"{path.suffix} datasets")
        try:
            rows = datasets.load_dataset(path.suffix[1:], data_files=str(path), split="train")
        except Exception as error:  # noqa: BLE001 - the loader's own errors name the problem
            raise DatasetError(f"dataset {path}: cannot be read: {error}") from None
    elif path.is_dir():
        rows = _saved_dataset(path, split)
    else:
        raise DatasetError(f"dataset {path}: unsupported format (use .jsonl, .parquet, .json, .csv, or a "
                           "directory written by datasets' save_to_disk)")
    for index, row in enumerate(rows, start=1):
        yield f"{path}:row {index}", row


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
    return loaded


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


def load_splits(config: DataConfig, seed: int) -> PromptSplits:
    if config.synthetic is not None:
        train, eval_ = ([PromptRecord(e.prompt, e.label, {"task": e.task}) for e in split]
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
    eval_prompts = {record.prompt for record in eval_}
    train = [record for record in train if record.prompt not in eval_prompts]
    if not train:
        raise DatasetError("no training prompts are left after removing those in the eval split")
    return PromptSplits(train=train, eval=eval_, skipped_rows=skipped)


class PromptSampler:
    """Deterministic epoch-shuffled batches; its position is the (epoch, index) pair."""

    def __init__(self, records: list[PromptRecord], batch_size: int, seed: int):
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

    def next_batch(self) -> list[PromptRecord]:
        batch = []
        while len(batch) < self.batch_size:
            if self.index >= len(self._order):
                self.epoch += 1
                self.index = 0
                self._order = self._shuffled_order()
            batch.append(self.records[self._order[self.index]])
            self.index += 1
        return batch
