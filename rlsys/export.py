"""`rlsys export RUN_DIR OUT [--step N]`: a run checkpoint as a Hugging Face safetensors model."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from rlsys.checkpointing import CheckpointStore
from rlsys.config import ConfigError, load_config

_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
    "merges.txt", "tokenizer.model", "chat_template.jinja", "generation_config.json",
)


def export_hf(run_dir: str | Path, step: int | None, out_dir: str | Path) -> Path:
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    run_dir, out_dir = Path(run_dir), Path(out_dir)
    store = CheckpointStore(run_dir)
    checkpoint = store.latest() if step is None else store.path_for(step)
    if checkpoint is None or not (checkpoint / "dcp").is_dir():
        available = [p.name for p in store.complete_checkpoints()]
        raise ConfigError(f"no checkpoint {'(latest)' if step is None else step} in {run_dir}; found {available}")
    config = load_config(run_dir / "config.yaml")
    base = Path(config.model.path)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    # The trainer's DCP keys are the model's own parameter names; load only the model part.
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(checkpoint / "dcp"))
    model.load_state_dict(state["model"])
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer_dir = Path(config.model.tokenizer_dir)
    for name in _TOKENIZER_FILES:
        source = tokenizer_dir / name if (tokenizer_dir / name).is_file() else base / name
        if source.is_file():
            shutil.copy2(source, out_dir / name)
    return out_dir
