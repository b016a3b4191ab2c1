"""RunConfig: a run's whole configuration, one section per part of the run (this package's other
modules), and the one resolution step after loading."""

from __future__ import annotations

from pydantic import Field, model_validator

from rlsys.config.algorithm import AlgorithmConfig
from rlsys.config.checkpoint import CheckpointConfig
from rlsys.config.data import DataConfig
from rlsys.config.eval import EvalConfig
from rlsys.config.model import ModelConfig
from rlsys.config.observability import LoggingConfig, ProfileConfig, StatusConfig
from rlsys.config.placement import PlacementConfig
from rlsys.config.reward import RewardConfig
from rlsys.config.rollout import RolloutConfig
from rlsys.config.rules import check_across_sections, check_task
from rlsys.config.task import TaskConfig
from rlsys.config.trainer import TrainerConfig
from rlsys.config.weight_sync import WeightSyncConfig
from rlsys.section import Section


class RunConfig(Section):
    run_dir: str | None = Field(None, description="Where outputs go; runs/<timestamp> when unset.")
    seed: int = Field(0, description="Seed of the data split and prompt order, the engines' sampling and the "
                      "trainers' torch RNG.")
    model: ModelConfig = Field(description="The policy model.")
    data: DataConfig = Field(default_factory=DataConfig, description="Training and eval prompts.")
    task: TaskConfig = Field(default_factory=TaskConfig, description="A task from an environment hub (a verifiers "
                             "environment) instead of a dataset and a reward function.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="How samples are scored.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Generation by the SGLang engines.")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="The FSDP2 trainer ranks.")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="The GRPO loss and its options.")
    weight_sync: WeightSyncConfig = Field(
        default_factory=WeightSyncConfig, description="Moving the trainer's weights into the engines after each step.",
    )
    placement: PlacementConfig = Field(default_factory=PlacementConfig, description="Where trainers and engines run.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Evaluation on the held-out prompts.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpoints and resume.")
    status: StatusConfig = Field(default_factory=StatusConfig, description="The dashboard and REST API.")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Progress and experiment tracking.")
    profile: ProfileConfig = Field(default_factory=ProfileConfig, description="Profiling of chosen steps.")

    @model_validator(mode="after")
    def _sections_fit_together(self):
        self.rollout.mode.check(self)
        check_across_sections(data=self.data, rollout=self.rollout, trainer=self.trainer, algorithm=self.algorithm,
                              placement=self.placement, profile=self.profile)
        check_task(self.task, self.data, self.reward, self.rollout)
        return self


def resolve_derived_settings(config: RunConfig) -> RunConfig:
    """The one resolution step after loading: the settings whose defaults depend on other sections
    filled in (`AlgorithmConfig.resolved`: the loss's aggregation, loss_norm_tokens, whether TIS is
    on), so every process reads one value and RUN_DIR/config.yaml shows what ran. Idempotent."""
    rollout = config.rollout
    return config.model_copy(update={"algorithm": config.algorithm.resolved(rollout.max_new_tokens,
                                                                            rollout.mode.off_policy)})
