"""task: a task taken from an environment hub instead of a dataset and a reward function: a
`verifiers` environment (its dataset, rubric and, multi-turn, its turns). rlsys/environments/ holds
the bridge."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from rlsys.section import Section


class VerifiersTaskConfig(Section):
    module: str = Field(
        description="The environment: an installed module's name (`vf-math` and `vf_math` are one module) or a "
        "path/to/env.py, whose load_environment(**args) returns a verifiers Environment. Its dataset is the data "
        "(eval_dataset the eval split), its rubric the reward (each function's value logged as reward/<name>), "
        "and a MultiTurnEnv's env_response (a ToolEnv's tools) makes the turns after the model's.",
    )
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of load_environment.")
    num_train: int | None = Field(None, ge=1, description="Train on the first this many rows of the dataset (all: "
                                  "unset).")
    num_eval: int | None = Field(None, ge=1, description="Evaluate on the first this many rows of eval_dataset.")


class TaskConfig(Section):
    verifiers: VerifiersTaskConfig | None = Field(
        None, description="A verifiers environment: data, reward and turns (instead of data.train_path and "
        "reward.function).",
    )

    @property
    def is_set(self) -> bool:
        return self.verifiers is not None
