"""checkpoint: checkpoints and resume."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlsys.section import Section


class CheckpointConfig(Section):
    interval: int = Field(0, ge=0, description="Save every this many steps (and at the end); 0 = never.")
    keep_last: int = Field(2, ge=1, description="Complete checkpoints kept; older ones are deleted.")
    resume: Literal["never", "auto"] = Field(
        "never", description="auto: continue from the latest complete checkpoint in run_dir, if any."
    )
    max_auto_resumes: int = Field(
        0, ge=0, description="When a trainer rank dies, restart the trainers from the latest checkpoint this many "
        "times over the run (0: the run fails).",
    )
