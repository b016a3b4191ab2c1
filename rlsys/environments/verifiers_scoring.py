"""A verifiers environment's rubric as the run's reward scorer (the `start / score / close` of
RewardPool): each GRPO group is scored together by the rubric's own `score_group` (weighted
functions, async ones, group-level ones), and each function's value comes back as a part of the
outcome (logged as rubric_<name>, the mean over the step's samples).

A single-turn sample's completion is one assistant message holding the response text the reward
reads (reward.skip_special_tokens); a multi-turn sample is scored on the vf.State its turns built
(rlsys/environments/verifiers_turns.py), found by the id its generation's info carries. A group
whose rubric raises or runs past reward.timeout_s is an error outcome for each of its samples (the
reward's error policy: dropped, counted, reward.max_error_fraction)."""

from __future__ import annotations

import re
import traceback

from rlsys.environments.verifiers_rows import ROW_KEY
from rlsys.records import RewardCall, RewardOutcome
from rlsys.rollout.dispatch import LoopThread

STATE_KEY = "verifiers_state"  # a multi-turn generation's info: the id of the state its turns built


class RubricScorer:
    def __init__(self, task, timeout_s: float, states: dict | None = None):
        """`task`: the VerifiersTask (rlsys/environments/verifiers_task.py) whose rubric scores."""
        self.task = task
        self.timeout_s = timeout_s
        self.states = states if states is not None else {}  # filled by the multi-turn generate function
        self.loop: LoopThread | None = None

    def start(self) -> None:
        self.loop = LoopThread("rlsys-rubric")

    def close(self) -> None:
        if self.loop is not None:
            self.loop.close()

    def score(self, calls: list[RewardCall]) -> list[RewardOutcome]:
        """One outcome per call, in order; consecutive calls of one dataset row are one group."""
        outcomes: list[RewardOutcome] = []
        for group in _groups(calls):
            outcomes += self._score_group(group)
        return outcomes

    def _score_group(self, calls: list[RewardCall]) -> list[RewardOutcome]:
        try:
            states = [self._state(call) for call in calls]
            future = self.loop.submit(self.task.environment.rubric.score_group(states))
            try:
                future.result(self.timeout_s)
            except TimeoutError:
                future.cancel()
                raise
        except TimeoutError:
            return [RewardOutcome(error=f"the rubric took longer than {self.timeout_s:g}s on a group "
                                        "(reward.timeout_s)")] * len(calls)
        except Exception:  # noqa: BLE001 - a user's rubric may raise anything: the group's error
            return [RewardOutcome(error=traceback.format_exc(limit=-4))] * len(calls)
        return [_outcome(state) for state in states]

    def _state(self, call: RewardCall):
        from verifiers.utils.message_utils import normalize_messages

        state_id = call.metadata.get(STATE_KEY)
        if state_id is not None:  # multi-turn: the state its turns built
            return self.states.pop(state_id)
        state = self.task.new_state(self.task.row_of(call.metadata))
        completion = normalize_messages([{"role": "assistant", "content": call.response}], field_name="completion")
        # One turn, as SingleTurnEnv's rollout records it (a MultiTurnEnv's num_turns metric reads it).
        state["trajectory"].append({"prompt": state["prompt"], "completion": completion, "response": None,
                                    "tokens": None, "reward": None, "advantage": None, "is_truncated": False,
                                    "trajectory_id": "", "extras": {}})
        state["completion"] = completion
        state["is_completed"] = True
        return state


def _groups(calls: list[RewardCall]) -> list[list[RewardCall]]:
    groups: list[list[RewardCall]] = []
    for call in calls:
        if groups and groups[-1][0].metadata[ROW_KEY] == call.metadata[ROW_KEY]:
            groups[-1].append(call)
        else:
            groups.append([call])
    return groups


def _outcome(state) -> RewardOutcome:
    from rlsys.rewards.loading import reward_value_problem

    value = state.get("reward")
    problem = reward_value_problem(value)
    if problem is not None:
        return RewardOutcome(error=f"the rubric's reward {value!r} is {problem}")
    parts = {re.sub(r"\W", "_", name): float(v) for name, v in (state.get("metrics") or {}).items()
             if reward_value_problem(v) is None}
    return RewardOutcome(value=float(value), parts=parts)
