"""`rlsys export RUN_DIR OUT [--step N] [--merged]`: a run checkpoint as a Hugging Face safetensors
model; a LoRA run's as a PEFT adapter (adapter_config.json, adapter_model.safetensors: what
`PeftModel.from_pretrained` and SGLang's --lora-paths load), or with --merged as the base model
with the adapters merged in."""

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
    # a vision-language model's processor: AutoProcessor reads these beside the tokenizer's
    "processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json", "chat_template.json",
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


def _read_checkpoint(state: dict, checkpoint: Path) -> None:
    import torch.distributed.checkpoint as dcp

    try:
        dcp.load(state, checkpoint_id=str(checkpoint / "dcp"))
    except Exception as error:  # noqa: BLE001 - a damaged shard the size check could not see
        raise ConfigError(f"checkpoint {checkpoint} cannot be read ({type(error).__name__}: {error}); "
                          "export another one with --step N") from None


def _with_adapters(model, lora, checkpoint: Path, base_id: str):
    """`model` as a PeftModel holding the checkpoint's adapters (the trainer's DCP keys are the
    injected model's own names, `...q_proj.lora_A.default.weight`)."""
    from peft import get_peft_model

    from rlsys.actors.lora import lora_settings

    settings = lora_settings(model.config, lora.rank, lora.alpha, lora.dropout, lora.target_modules,
                             base_model_name_or_path=base_id)
    peft_model = get_peft_model(model, settings)
    inner = peft_model.base_model.model  # the transformers model, adapters injected: the trainer's names
    adapters = {name: param.detach() for name, param in inner.named_parameters() if ".lora_" in name}
    state = {"model": {name: torch.empty_like(tensor) for name, tensor in adapters.items()}}
    _read_checkpoint(state, checkpoint)
    with torch.no_grad():
        for name, tensor in adapters.items():
            tensor.copy_(state["model"][name])
    return peft_model


def _clear_output_dir(out_dir: Path, overwrite: bool) -> None:
    """A directory that holds files is refused (an export's files written over another's leave a mix:
    an adapter beside a merged model's weights), or with `overwrite` emptied first, said."""
    if not out_dir.is_dir():
        return
    entries = sorted(entry.name for entry in out_dir.iterdir())
    if not entries:
        return
    listed = ", ".join(entries[:4]) + (f" and {len(entries) - 4} more" if len(entries) > 4 else "")
    if not overwrite:
        raise UsageError(f"cannot export to {out_dir}: it holds files already ({listed}); choose a new or empty "
                         "directory, or pass --overwrite to replace what it holds")
    logger.warning("--overwrite: removing what %s held (%s) before writing the export", out_dir, listed)
    shutil.rmtree(out_dir)


def export_hf(run_dir: str | Path, step: int | None, out_dir: str | Path, merged: bool = False,
              overwrite: bool = False) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from rlsys.actors.loading import is_vision_language

    run_dir, out_dir = Path(run_dir), Path(out_dir)
    checkpoint = checkpoint_to_export(CheckpointStore(run_dir), step)
    config = load_config(run_dir / "config.yaml")
    _clear_output_dir(out_dir, overwrite)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(f"cannot export to {out_dir}: {why_not_a_directory(out_dir, error)}; "
                         "choose another output directory") from None
    if merged and config.model.lora is None:
        raise ConfigError(f"--merged: the run in {run_dir} trained every weight (no model.lora): its export is "
                          "the whole model already; leave --merged out")
    base = Path(config.model.path)
    model_class = AutoModelForImageTextToText if is_vision_language(AutoConfig.from_pretrained(str(base))) \
        else AutoModelForCausalLM
    model = model_class.from_pretrained(str(base), dtype=torch.float32)
    if config.model.lora is not None:
        peft_model = _with_adapters(model, config.model.lora, checkpoint, config.model.hub_id or str(base))
        if merged:
            peft_model.merge_and_unload().save_pretrained(str(out_dir), safe_serialization=True)
        else:
            peft_model.save_pretrained(str(out_dir), safe_serialization=True)
    else:
        # The trainer's DCP keys are the model's own parameter names; load only the model part.
        state = {"model": model.state_dict()}
        _read_checkpoint(state, checkpoint)
        model.load_state_dict(state["model"])
        model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer_dir = Path(config.model.tokenizer_dir)
    for name in _TOKENIZER_FILES:
        source = tokenizer_dir / name if (tokenizer_dir / name).is_file() else base / name
        if source.is_file():
            shutil.copy2(source, out_dir / name)
    if problem := auto_tokenizer_problem(tokenizer_dir, out_dir):
        logger.warning("%s", problem)
    return out_dir


_PROBE_TEXTS = ("Hello world", "The answer is 42.", " 7 + 35 = 42\n", "a b  c\td")


def auto_tokenizer_problem(run_tokenizer_dir: Path, export_dir: Path) -> str | None:
    """Whether transformers' AutoTokenizer on the export tokenizes as the run did (rlsys loads a
    tokenizer saved as PreTrainedTokenizerFast as that class, rlsys/data/tokenizer.py; AutoTokenizer
    in transformers 5 may rebuild it from the model type instead); a warning's text if not. Probes:
    a few sentences and the run's first 256 tokens decoded."""
    from transformers import AutoTokenizer

    from rlsys.data.tokenizer import load_tokenizer

    run_tokenizer = load_tokenizer(run_tokenizer_dir)
    how = f"load it as rlsys did: PreTrainedTokenizerFast.from_pretrained({str(export_dir)!r})"
    try:
        auto = AutoTokenizer.from_pretrained(str(export_dir))
    except Exception as error:  # noqa: BLE001 - any failure is the finding
        return f"AutoTokenizer cannot load the export's tokenizer ({type(error).__name__}: {error}); {how}"
    texts = [*_PROBE_TEXTS, run_tokenizer.decode(list(range(min(256, len(run_tokenizer)))))]
    for text in texts:
        ours, theirs = run_tokenizer.encode(text), auto.encode(text)
        if ours != theirs:
            return (f"AutoTokenizer loads the export's tokenizer as {type(auto).__name__}, which tokenizes "
                    f"differently from the run's {type(run_tokenizer).__name__} ({text[:40]!r}: {theirs[:8]} against "
                    f"{ours[:8]}); {how}")
    return None
