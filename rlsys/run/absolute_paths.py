"""A run's config with every file path it names made absolute, before anything starts: trainers
and engines on other nodes (or in another working directory) resolve none against their own, and
RUN_DIR/config.yaml runs again from anywhere."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from rlsys.config import RunConfig


def default_run_dir() -> str:
    """Where a run with no run_dir writes: runs/ under the working directory, by start time."""
    return f"runs/{datetime.now():%Y%m%d-%H%M%S}"


def with_absolute_paths(config: RunConfig, run_dir: str) -> RunConfig:
    """The config with run_dir, the model's, the data's and the user functions' file paths made
    absolute: trainers and engines on other nodes (or in another working directory) must not resolve
    them against their own, and RUN_DIR/config.yaml must run again from anywhere. A function named
    as a module (`package.module:function`) is left as it is: it is found on the Python path."""

    def absolute(path: str | None) -> str | None:
        return str(Path(path).absolute()) if path else path

    model = config.model.model_copy(update={"path": absolute(config.model.path),
                                            "tokenizer_path": absolute(config.model.tokenizer_path)})
    data = config.data.model_copy(update={"train_path": absolute(config.data.train_path),
                                          "eval_path": absolute(config.data.eval_path)})
    reward = config.reward.model_copy(update={"function": absolute_function_path(config.reward.function)})
    rollout = config.rollout.model_copy(update={
        "generate_function": absolute_function_path(config.rollout.generate_function)})
    eval_sets = [eval_set.model_copy(update={"path": absolute(eval_set.path),
                                             "reward_function": absolute_function_path(eval_set.reward_function)})
                 for eval_set in config.eval.datasets]
    return config.model_copy(update={
        "run_dir": str(Path(run_dir).absolute()), "model": model, "data": data, "reward": reward, "rollout": rollout,
        "eval": config.eval.model_copy(update={"datasets": eval_sets})})


def absolute_function_path(import_path: str | None) -> str | None:
    """`path/to/file.py:function` with the file's path made absolute; other forms as they are."""
    if not import_path:
        return import_path
    module, sep, attribute = import_path.rpartition(":")
    if not sep or not module.endswith(".py"):
        return import_path
    return f"{Path(module).absolute()}:{attribute}"
