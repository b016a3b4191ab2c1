"""What the trainer ranks check of the model before they build it, and the shapes the memory plan
reads: run on trainer rank 0 (`TrainerWorker.model_report`), which imports transformers' modeling
code to build its model anyway, so the driver never does (~5 CPU-seconds of every start, and the
driver's start comes before anything else: bench/startup.py). `rlsys plan`, `rlsys doctor` and
`rlsys engines up` call the same functions in their own process."""

from __future__ import annotations

from pathlib import Path

from rlsys.config import ConfigError, LoraConfig
from rlsys.model.architecture import read_architecture
from rlsys.model.built import trained_model
from rlsys.model.shape import ModelShape


def model_report(model_dir: str | Path, lora: LoraConfig | None = None) -> ModelShape:
    """The model's shapes for the memory plan, once transformers can build it (`read_architecture`:
    a model type it knows, a causal LM, fields of the right types; the driver reads config.json alone)
    and `check_the_trainer_can_load` passes (ConfigError if not)."""
    read_architecture(model_dir)
    check_the_trainer_can_load(Path(model_dir), lora)
    return ModelShape.from_model_dir(model_dir, lora)


def check_the_trainer_can_load(model_dir: Path, lora: LoraConfig | None = None) -> None:
    """Every parameter of the model config.json describes has its tensor(s) in the weight files, as
    the trainer ranks read them (actors/loading.py), checked before the ranks build their models; and
    the model stores no parameter in a layout rlsys does not read."""
    from rlsys.actors.checkpoint_layout import unsupported_layouts
    from rlsys.actors.loading import build_empty_model, parameters_without_tensor

    model = build_empty_model(str(model_dir), "sdpa")
    trained_model(model_dir, lora)  # target_modules that match nothing
    if unsupported := unsupported_layouts(model):
        raise ConfigError(f"invalid config: model.path {model_dir}: transformers converts parameters of this "
                          f"architecture ({', '.join(unsupported[:3])}) from its checkpoint in a way rlsys does not "
                          "read; supported architectures: docs/gpus-and-clusters.md")
    if not any(model_dir.glob("*.safetensors")):
        return  # .bin weights: the trainer refuses them with its own message
    missing = parameters_without_tensor(model_dir)
    if missing:
        raise ConfigError(f"invalid config: model.path {model_dir}: {len(missing)} parameter(s) of the model have "
                          f"no tensor of that name in its weight files (e.g. {', '.join(missing[:3])}): config.json "
                          "and the weight files disagree; point model.path at a complete Hugging Face checkpoint")
