"""The tokenizer saved beside a model, loaded the way its files ask."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import logging
import os
from importlib.metadata import version
from pathlib import Path

logger = logging.getLogger(__name__)

# What AutoTokenizer reads to choose a tokenizer class, and the class then reads: a tokenizer whose
# files (and model type) are the same gets the same class from the same transformers.
_CLASS_INPUTS = ("tokenizer_config.json", "config.json", "tokenizer.json", "special_tokens_map.json",
                 "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")
# Tokenizers whose chosen class is remembered (most recent last); older ones are forgotten.
_REMEMBERED = 256


def load_tokenizer(model_dir: str | Path):
    """Load the tokenizer saved beside a model.

    `PreTrainedTokenizerFast` is used on purpose: `AutoTokenizer` in transformers 5 may rebuild a
    Qwen2 BPE tokenizer from the model type and ignore the saved `tokenizer.json`.

    Otherwise `AutoTokenizer` chooses the class, once per tokenizer: importing it costs ~2 CPU-seconds
    of every run's serial start (transformers' tokenization_auto imports its auto modeling code through
    a config class's @auto_docstring), and all it decides is which class's `from_pretrained` to call on
    the directory. That choice is remembered (`tokenizer_classes_file`), keyed by the tokenizer's files,
    the model type's config.json and transformers' version, and the next load calls that class itself.
    """
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    if config.get("tokenizer_class") == "PreTrainedTokenizerFast":
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    key = _class_key(model_dir)
    remembered = _remembered_classes().get(key)
    if remembered is not None:
        try:
            return getattr(importlib.import_module(remembered[0]), remembered[1]).from_pretrained(str(model_dir))
        except (ImportError, AttributeError) as error:  # another transformers under the same version string
            logger.debug("the remembered tokenizer class %s is gone (%s); asking AutoTokenizer", remembered, error)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    _remember(key, type(tokenizer))
    return tokenizer


def tokenizer_classes_file() -> Path:
    """Where the tokenizer classes AutoTokenizer chose are remembered: $RLSYS_CACHE_DIR, else
    $XDG_CACHE_HOME/rlsys, else ~/.cache/rlsys."""
    root = os.environ.get("RLSYS_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rlsys"
    return Path(root) / "tokenizer-classes.json"


def _class_key(model_dir: Path) -> str:
    digest = hashlib.blake2b(version("transformers").encode(), digest_size=16)
    for name in _CLASS_INPUTS:
        path = model_dir / name
        if path.is_file():
            digest.update(f"\0{name}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _remembered_classes() -> dict[str, list[str]]:
    try:
        remembered = json.loads(tokenizer_classes_file().read_text())
    except (OSError, ValueError):  # none yet, unreadable or cut short: AutoTokenizer chooses again
        return {}
    return remembered if isinstance(remembered, dict) else {}


def _remember(key: str, cls: type) -> None:
    """Records `cls` for `key` (written whole: a file replaced, never half-written); a transformers
    class only (remote code is not remembered), and nothing when the cache cannot be written."""
    if not cls.__module__.startswith("transformers.") or getattr(importlib.import_module(cls.__module__),
                                                                   cls.__name__, None) is not cls:
        return
    path = tokenizer_classes_file()
    remembered = _remembered_classes()
    remembered.pop(key, None)
    remembered[key] = [cls.__module__, cls.__name__]
    kept = dict(list(remembered.items())[-_REMEMBERED:])
    scratch = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch.write_text(json.dumps(kept))
        os.replace(scratch, path)
    except OSError as error:
        logger.debug("cannot remember the tokenizer class in %s: %s", path, error)
        with contextlib.suppress(OSError):
            scratch.unlink(missing_ok=True)
