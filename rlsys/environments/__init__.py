"""Tasks from environment hubs: a `verifiers` environment (task.verifiers: its dataset, rubric and
turns) or an OpenEnv server (task.openenv: reset/step episodes and their rewards). Each bridge gives
the run its prompts (verifiers), its reward scorer and its generate function; nothing here is copied
from those packages, which are imported as installed (requirements/environments.txt)."""
