"""The tokenizer saved beside a model, loaded the way its files ask."""

from __future__ import annotations

import json
from pathlib import Path


def load_tokenizer(model_dir: str | Path):
    """Load the tokenizer saved beside a model.

    `PreTrainedTokenizerFast` is used on purpose: `AutoTokenizer` in transformers 5 may rebuild a
    Qwen2 BPE tokenizer from the model type and ignore the saved `tokenizer.json`.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    if config.get("tokenizer_class") == "PreTrainedTokenizerFast":
        return PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    return AutoTokenizer.from_pretrained(str(model_dir))
