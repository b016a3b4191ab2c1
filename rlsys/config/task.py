"""task: a task taken from an environment hub instead of a dataset and a reward function: a
`verifiers` environment (its dataset, rubric and, multi-turn, its turns) or an OpenEnv environment
server (reset/step episodes and their rewards). rlsys/environments/ holds the bridges."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

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


class OpenEnvTaskConfig(Section):
    url: str | None = Field(
        None, description="A running OpenEnv environment server (http://host:port). Unset: rlsys starts `command`.",
    )
    command: list[str] | None = Field(
        None, description="Starts the environment server on this machine, each `{port}` replaced by a free port and "
        "`{python}` by the run's Python (e.g. ['{python}', -m, uvicorn, my_env.server:app, --port, '{port}']); "
        "stopped when the run ends.",
    )
    start_timeout_s: float = Field(60.0, gt=0, description="How long a started server may take to answer /health.")
    action_field: str = Field(
        "message", description="The action's field that carries the model's reply: step() is sent {action_field: "
        "the reply's text}.",
    )
    observation_field: str | None = Field(
        None, description="The observation's field whose text the model reads after a step that did not end the "
        "episode (appended to the sequence as injected tokens, masked out of the loss); unset: none is shown.",
    )
    max_turns: int = Field(1, ge=1, description="Steps per episode at most (it ends earlier when the environment "
                           "says done).")
    max_sessions: int = Field(16, ge=1, description="Episodes open on the server at once (each is a WebSocket "
                              "session with an environment of its own).")
    timeout_s: float = Field(60.0, gt=0, description="A reset or step answered later than this fails the episode: "
                             "its sample is a reward error (reward.max_error_fraction).")

    @model_validator(mode="after")
    def _one_server(self):
        if (self.url is None) == (self.command is None):
            raise ValueError("task.openenv: set exactly one of url (a running server) or command (rlsys starts it)")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"task.openenv.url must be an http:// or https:// URL (got {self.url!r})")
        return self


class TaskConfig(Section):
    verifiers: VerifiersTaskConfig | None = Field(
        None, description="A verifiers environment: data, reward and turns (instead of data.train_path and "
        "reward.function).",
    )
    openenv: OpenEnvTaskConfig | None = Field(
        None, description="An OpenEnv environment: each sample is an episode (reset, then one step per model turn, "
        "the reply's text as the action); the sum of its step rewards is the sample's reward. The prompts come from "
        "the data section.",
    )

    @model_validator(mode="after")
    def _one_environment(self):
        if self.verifiers is not None and self.openenv is not None:
            raise ValueError("set at most one of task.verifiers and task.openenv")
        return self

    @property
    def is_set(self) -> bool:
        return self.verifiers is not None or self.openenv is not None
