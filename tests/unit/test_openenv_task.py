"""task.openenv without a server: the config's rules and the episode rewards as the run's scorer."""

from __future__ import annotations

import pytest

from rlsys.config import OpenEnvTaskConfig, RunConfig
from rlsys.environments.openenv_task import EPISODE_KEY, EpisodeRewards, OpenEnvTask
from rlsys.records import RewardCall

SYNTHETIC = {"synthetic": {"task": "last_digit"}}


@pytest.mark.parametrize("section, refused", [
    ({}, "exactly one of url"),
    ({"url": "http://127.0.0.1:1", "command": ["x"]}, "exactly one of url"),
    ({"url": "ws://127.0.0.1:1"}, "http:// or https://"),
])
def test_an_openenv_task_names_one_server(section, refused):
    with pytest.raises(ValueError, match=refused):
        OpenEnvTaskConfig.model_validate(section)


@pytest.mark.parametrize("sections, refused", [
    ({}, "data.train_path, data.synthetic or task.verifiers"),  # its prompts come from the data section
    ({"data": SYNTHETIC, "reward": {"function": "my.mod:fn"}}, "task.openenv \\(its step rewards\\)"),
    ({"data": SYNTHETIC, "rollout": {"generate_function": "my.mod:gen"}}, "leave rollout.generate_function"),
    ({"data": SYNTHETIC, "task": {"verifiers": {"module": "m"}}}, "at most one of task.verifiers and task.openenv"),
])
def test_an_openenv_task_is_the_one_source_of_reward_and_turns(sections, refused):
    task = {"openenv": {"url": "http://127.0.0.1:1"}, **sections.pop("task", {})}
    with pytest.raises(ValueError, match=refused):
        RunConfig.model_validate({"model": {"path": "m"}, "task": task, **sections})


def test_an_episodes_reward_is_its_samples_and_a_failed_episode_is_a_reward_error():
    scorer = EpisodeRewards(OpenEnvTask(OpenEnvTaskConfig(url="http://127.0.0.1:1")))
    episodes = [{"reset": {}, "steps": [{"reward": 0.5}, {"reward": 1.0}], "reward": 1.5, "error": None},
                {"reset": {}, "steps": [], "reward": 0.0, "error": "ConnectionError: refused"}]
    outcomes = scorer.score([RewardCall("p", "r", "l", {EPISODE_KEY: e}) for e in episodes]
                            + [RewardCall("p", "r", "l", {})])
    assert outcomes[0].value == 1.5 and outcomes[0].error is None
    assert outcomes[1].value is None and "ConnectionError: refused" in outcomes[1].error
    assert "no OpenEnv episode" in outcomes[2].error
