"""rollout.mode sync: each step's batch generated at its start from the weights just synced (the
runner's defaults: on-policy rounds, in the loop's thread)."""

from __future__ import annotations

from rlsys.config import SyncMode
from rlsys.run.rollout_modes.base import ModeRunner, runs_mode


@runs_mode(SyncMode)
class SyncRunner(ModeRunner):
    pass
