"""status, logging and profile: the dashboard, progress and trackers, and profiling."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from rlsys.section import Section


class StatusConfig(Section):
    enabled: bool = Field(True, description="Serve the dashboard and REST API from the coordinator.")
    host: str = Field("127.0.0.1", description="Bind address; keep loopback unless you set a token.")
    port: int = Field(8470, ge=0, le=65535, description="0 picks a free port.")
    token: str | None = Field(
        None, description="Bearer token for control calls (and for reads when host is not loopback); falls back "
        "to $RLSYS_STATUS_TOKEN. None: control off.",
    )
    allow_unauthenticated_read: bool = Field(
        False, description="Serve status and metrics without a token on a non-loopback host (otherwise refused).",
    )


class LoggingConfig(Section):
    progress_bar: bool = Field(True, description="Show a progress bar of the steps in the terminal (only where "
                               "stderr is a terminal). Off, or in a log: a line per eval and a step summary every "
                               "summary_interval_s instead.")
    summary_interval_s: float = Field(30.0, ge=0.0, description="Without a progress bar, the least seconds between "
                                      "two step summary lines (the first and last steps always get one).")
    backends: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=list, description="Where metrics go besides RUN_DIR/metrics.jsonl "
        "(rlsys/observability/tracking.py): "
        "TensorBoard event files, wandb (offline unless configured), MLflow (a file store in the run directory).",
    )
    samples_per_step: int = Field(
        4, ge=0, le=64, description="Answers kept per step and per eval set, with their prompt, reward and finish "
        "reason (the first answer of the first N prompts): in RUN_DIR/samples.jsonl, the dashboard's table, the "
        "trackers' tables. 0: none.")
    save_rollouts: bool = Field(
        False, description="Every trained sample of every step, as the trainer got it (token ids, engine log-probs, "
        "reward, advantage, loss mask, texts), to RUN_DIR/rollouts/step_NNNNNN.jsonl: for reading a run's batches "
        "back or replaying them through another trainer (bench/replay.py). Grows by a step's samples every step.")
    project: str = Field("rlsys", description="wandb project / MLflow experiment.")
    run_name: str | None = Field(None, description="Run name in wandb/MLflow; default: the run directory's name.")


class ProfileConfig(Section):
    steps: tuple[int, int] | None = Field(
        None, description="First and last step (inclusive) to profile: torch.profiler traces of every trainer rank "
        "(all they do in those steps, the weight sync and sleep/wake included) and a timeline of the driver's phases, "
        "written to RUN_DIR/profile/ (docs/operations.md \"Profiling\"). None: off, nothing recorded, no cost.",
    )

    @field_validator("steps")
    @classmethod
    def _ordered(cls, steps):
        if steps is not None and not 0 <= steps[0] <= steps[1]:
            raise ValueError(f"profile.steps must be [first, last] with 0 <= first <= last (got {list(steps)})")
        return steps
