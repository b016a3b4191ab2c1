"""`rlsys export RUN_DIR OUT [--step N]`: a run checkpoint as a Hugging Face safetensors model."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch

from rlsys.config import ConfigError, load_config
from rlsys.errors import UsageError, why_not_a_directory
from rlsys.run.checkpointing import CheckpointStore, trainer_state_problem

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
    "merges.txt", "tokenizer.model", "chat_template.jinja", "generation_config.json",
)


def checkpoint_to_export(store: CheckpointStore, step: int | None) -> Path:
    """The checkpoint of `step`, or (None) the latest whose trainer state is whole: an incomplete
    latest one is passed over with a note naming it and the one exported instead."""
    complete = store.complete_checkpoints()
    steps = [int(p.name.removeprefix("step_")) for p in complete]
    if step is not None:
        if not store.has(step):
            raise ConfigError(f"no checkpoint of step {step} in {store.root.parent}; the checkpointed steps: {steps}")
        problem = trainer_state_problem(store.path_for(step))
        if problem:
            usable = [s for s, p in zip(steps, complete, strict=True) if s != step and not trainer_state_problem(p)]
            raise ConfigError(f"checkpoint {store.path_for(step)} is incomplete: {problem}; "
                              + (f"export another with --step N, one of {usable}" if usable else "no other checkpoint "
                                 "is complete"))
        return store.path_for(step)
    checkpoint, passed_over = store.latest_loadable()
    if checkpoint is not None:
        for skipped, why in passed_over:
            logger.warning("%s is incomplete (%s); exporting %s, the latest complete checkpoint", skipped, why,
                           checkpoint.name)
        return checkpoint
    if not complete:
        raise ConfigError(f"no checkpoint in {store.root.parent} (checkpoints are in RUN_DIR/checkpoints/step_N)")
    raise ConfigError(f"no complete checkpoint in {store.root.parent}: "
                      + "; ".join(f"{p.name}: {why}" for p, why in passed_over))


def export_hf(run_dir: str | Path, step: int | None, out_dir: str | Path) -> Path:
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    run_dir, out_dir = Path(run_dir), Path(out_dir)
    checkpoint = checkpoint_to_export(CheckpointStore(run_dir), step)
    config = load_config(run_dir / "config.yaml")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(f"cannot export to {out_dir}: {why_not_a_directory(out_dir, error)}; "
                         "choose another output directory") from None
    base = Path(config.model.path)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    # The trainer's DCP keys are the model's own parameter names; load only the model part.
    state = {"model": model.state_dict()}
    try:
        dcp.load(state, checkpoint_id=str(checkpoint / "dcp"))
    except Exception as error:  # noqa: BLE001 - a damaged shard the size check could not see
        raise ConfigError(f"checkpoint {checkpoint} cannot be read ({type(error).__name__}: {error}); "
                          "export another one with --step N") from None
    model.load_state_dict(state["model"])
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer_dir = Path(config.model.tokenizer_dir)
    for name in _TOKENIZER_FILES:
        source = tokenizer_dir / name if (tokenizer_dir / name).is_file() else base / name
        if source.is_file():
            shutil.copy2(source, out_dir / name)
    return out_dir
