"""Prompt datasets: JSONL rows or a built-in synthetic task, split into train and eval.

A JSONL row is an object `{"prompt": str, "label": str | number, "metadata": {...}}`
(`metadata` optional). The eval split is never trained on: rows whose prompt appears in eval are
removed from train.
"""

from __future__ import annotations

import json
import random
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


def parse_row(raw: bytes | str, where: str) -> PromptRecord:
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
    unknown = set(row) - {"prompt", "label", "metadata"}
    if unknown:
        raise DatasetError(f"{where}: unknown field(s) {sorted(unknown)}; allowed: prompt, label, metadata")
    prompt = row.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise DatasetError(f"{where}: 'prompt' must be a non-empty string, got {prompt!r}")
    if "label" not in row:
        raise DatasetError(f"{where}: missing 'label'")
    label = row["label"]
    if isinstance(label, bool) or not isinstance(label, (str, int, float)):
        raise DatasetError(f"{where}: 'label' must be a string or a number, got {type(label).__name__}")
    metadata = row.get("metadata", {})
    if not isinstance(metadata, dict):
        raise DatasetError(f"{where}: 'metadata' must be an object, got {type(metadata).__name__}")
    return PromptRecord(prompt=prompt, label=str(label), metadata=metadata)


def read_jsonl(path: str | Path, skip_invalid: bool = False) -> tuple[list[PromptRecord], int]:
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
                records.append(parse_row(raw, f"{path}:{line_number}"))
            except DatasetError:
                if not skip_invalid:
                    raise
                skipped += 1
    if not records:
        raise DatasetError(f"dataset file {path} has no valid rows")
    return records, skipped


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
    train, skipped = read_jsonl(config.train_path, config.skip_invalid_rows)
    if config.eval_path:
        eval_, skipped_eval = read_jsonl(config.eval_path, config.skip_invalid_rows)
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
