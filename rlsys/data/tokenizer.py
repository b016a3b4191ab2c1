"""The tokenizer saved beside a model, loaded the way its files ask."""

from __future__ import annotations

import json
from pathlib import Path


def load_tokenizer(model_dir: str | Path):
    """Load the tokenizer saved beside a model.

    `PreTrainedTokenizerFast` is used on purpose: `AutoTokenizer` in transformers 5 may rebuild a
    Qwen2 BPE tokenizer from the model type and ignore the saved `tokenizer.json`.
    """
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    if config.get("tokenizer_class") == "PreTrainedTokenizerFast":
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    # Imported only here: transformers' tokenization_auto imports its auto modeling code (a config
    # class's @auto_docstring), ~1 CPU-second of the driver's serial start that a run whose
    # tokenizer names its class does not need.
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
