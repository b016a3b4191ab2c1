"""The run's task environment from its `task` section (None without one): loaded once, before
anything starts, by load_assets; the run takes its prompts, reward scorer and generate function."""

from __future__ import annotations

from rlsys.config import RunConfig


def load_task_environment(config: RunConfig):
    """A VerifiersTask, an OpenEnvTask, or None."""
    if config.task.verifiers is not None:
        from rlsys.environments.verifiers_task import VerifiersTask

        return VerifiersTask.load(config.task.verifiers)
    if config.task.openenv is not None:
        from rlsys.environments.openenv_task import OpenEnvTask

        return OpenEnvTask(config.task.openenv)
    return None
