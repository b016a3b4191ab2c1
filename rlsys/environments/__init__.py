"""Tasks from environment hubs: a `verifiers` environment (task.verifiers: its dataset, rubric and
turns). The bridge gives the run its prompts, its reward scorer and its generate function; nothing
here is copied from verifiers, which is imported as installed (requirements/environments.txt)."""
