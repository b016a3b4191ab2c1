"""task.verifiers: a `verifiers` environment as the run's task (verifiers 0.3.1's classic API,
`import verifiers as vf`).

The module's `load_environment(**task.verifiers.args)` returns a vf.Environment. Its dataset (rows
of `prompt` as chat messages, `answer`, `info`, as the environment formats them: its system prompt
and few-shot turns already in `prompt`) becomes the training prompts, its eval_dataset the eval
split; each record remembers its row (`metadata["verifiers_row"]`), so the rubric later scores the
sample against that row's answer and info. Its rubric is the reward (rlsys/environments/
verifiers_scoring.py); a MultiTurnEnv's turns come from rlsys/environments/verifiers_turns.py.
"""

from __future__ import annotations

import json
from copy import deepcopy
from dataclasses import dataclass, field

from rlsys.config import VerifiersTaskConfig
from rlsys.data.conversations import ConversationError, read_conversation
from rlsys.data.datasets import DatasetError, PromptSplits
from rlsys.environments.verifiers_rows import ROW_KEY, VerifiersTaskError, plain_message
from rlsys.plugins import load_user_function
from rlsys.records import PromptRecord


def load_environment(config: VerifiersTaskConfig):
    """The environment `task.verifiers.module` builds: `load_environment(**args)` of an installed module
    (a `-` in its name read as `_`, as verifiers' own loader does) or of a path/to/env.py."""
    import verifiers as vf

    module = config.module if config.module.endswith(".py") else config.module.replace("-", "_")
    builder = load_user_function(f"{module}:load_environment", "task.verifiers.module")
    try:
        environment = builder(**config.args)
    except TypeError as error:
        raise VerifiersTaskError(f"task.verifiers: load_environment of {config.module!r} does not take the arguments "
                                 f"{sorted(config.args)} (task.verifiers.args): {error}") from error
    if not isinstance(environment, vf.Environment):
        raise VerifiersTaskError(f"task.verifiers: load_environment of {config.module!r} returned "
                                 f"{type(environment).__name__}, not a verifiers Environment")
    return environment


def openai_tools(environment) -> tuple[dict, ...]:
    """The environment's tools as chat templates take them (OpenAI's function form)."""
    return tuple({"type": "function", "function": {"name": tool.name, "description": tool.description,
                                                   "parameters": tool.parameters}}
                 for tool in environment.tool_defs or [])


@dataclass
class VerifiersTask:
    """The loaded environment and its rows, by split ("train", "eval")."""

    config: VerifiersTaskConfig
    environment: object
    rows: dict[str, list[dict]] = field(default_factory=dict)
    # A multi-turn sample's vf.State, from its turns (verifiers_turns.py) to the rubric (verifiers_scoring.py).
    states: dict = field(default_factory=dict)

    @classmethod
    def load(cls, config: VerifiersTaskConfig) -> VerifiersTask:
        environment = load_environment(config)
        rows = {"train": _rows(environment.get_dataset(), config.num_train)}
        # No eval_dataset: no eval split (verifiers' get_eval_dataset would fall back to the training rows).
        environment.build_eval_dataset()
        eval_dataset = environment.eval_dataset
        rows["eval"] = _rows(eval_dataset, config.num_eval) if eval_dataset is not None else []
        if not rows["train"]:
            raise VerifiersTaskError(f"task.verifiers: the environment {config.module!r} has no training rows")
        return cls(config, environment, rows)

    @property
    def multi_turn(self) -> bool:
        import verifiers as vf

        # SingleTurnEnv is a MultiTurnEnv of one turn: one engine call per sample, the default path.
        return isinstance(self.environment, vf.MultiTurnEnv) and not isinstance(self.environment, vf.SingleTurnEnv)

    def splits(self) -> PromptSplits:
        tools = openai_tools(self.environment)
        return PromptSplits(train=[self._record("train", i, row, tools) for i, row in enumerate(self.rows["train"])],
                            eval=[self._record("eval", i, row, tools) for i, row in enumerate(self.rows["eval"])])

    def _record(self, split: str, index: int, row: dict, tools: tuple[dict, ...]) -> PromptRecord:
        where = f"task.verifiers {self.config.module!r} {split} row {index}"
        prompt = row.get("prompt")
        if not isinstance(prompt, list):
            raise DatasetError(f"{where}: its prompt is {type(prompt).__name__}, not a list of chat messages")
        try:
            messages, images, text = read_conversation([plain_message(m) for m in prompt], None)
        except ConversationError as error:
            raise DatasetError(f"{where}: prompt{error}") from None
        answer = row.get("answer", "")
        label = answer if isinstance(answer, str) else json.dumps(answer)
        return PromptRecord(prompt=text, label=label, metadata={ROW_KEY: [split, index]}, images=images,
                            messages=messages, tools=tools)

    def row_of(self, metadata: dict) -> dict:
        """The dataset row a sample's record came from (a deep copy: reward functions may change it)."""
        split, index = metadata[ROW_KEY]
        return deepcopy(self.rows[split][index])

    def new_state(self, row: dict):
        """A rollout's vf.State for `row`, as Environment.init_state makes it (minus the model client:
        rlsys's engines answer, not an OpenAI client)."""
        import verifiers as vf
        from verifiers.types import RolloutTiming, flatten_task_input
        from verifiers.utils.message_utils import normalize_messages

        if isinstance(row.get("info"), str):
            row["info"] = json.loads(row["info"])
        task = flatten_task_input(row)
        state = vf.State(input=task)
        state["task"] = task
        state["prompt"] = normalize_messages(row["prompt"], field_name="input.prompt")
        state.update(is_completed=False, is_truncated=False, trajectory=[], completion=None, reward=None,
                     metrics=None, error=None, final_env_response=None, timing=RolloutTiming(),
                     tool_defs=self.environment.tool_defs or [])
        return state

    def scorer(self, timeout_s: float):
        """The rubric as the run's reward scorer."""
        from rlsys.environments.verifiers_scoring import RubricScorer

        return RubricScorer(self, timeout_s, self.states)

    def generate_function(self):
        """A MultiTurnEnv's turns (None: one engine call per sample, the default)."""
        from rlsys.environments.verifiers_turns import VerifiersTurns

        return VerifiersTurns(self, self.states) if self.multi_turn else None

    def describe(self) -> str:
        kind = type(self.environment).__name__
        return f"the rubric of verifiers environment {self.config.module!r} ({kind})"


def _rows(dataset, limit: int | None) -> list[dict]:
    count = len(dataset) if limit is None else min(limit, len(dataset))
    return [dict(dataset[i]) for i in range(count)]
