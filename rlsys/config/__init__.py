"""Run configuration: pydantic v2 sections, one module each, loaded from YAML with dotted
command-line overrides (loading.py).

`load_config("configs/quickstart.yaml", ["trainer.lr=1e-5"])` returns a validated `RunConfig`
(run.py) or raises `ConfigError` naming every bad field and why, before any actor starts. Rules
that span sections are in rules.py; a rollout mode is a section of rollout_modes.py keyed on its
`type`, as a policy loss is one of rlsys/algorithms/policy_losses/ keyed on its `name`.
"""

from rlsys.config.algorithm import AlgorithmConfig, OverlongPenaltyConfig
from rlsys.config.checkpoint import CheckpointConfig
from rlsys.config.data import DataConfig, SyntheticTaskConfig
from rlsys.config.engine import CPU_STARTUP_TIMEOUT_S, GPU_STARTUP_TIMEOUT_S, EngineConfig, SamplingConfig
from rlsys.config.eval import EvalConfig, EvalSetConfig
from rlsys.config.loading import ConfigError, apply_override, dump_config, load_config
from rlsys.config.model import LoraConfig, ModelConfig
from rlsys.config.observability import LoggingConfig, ProfileConfig, StatusConfig
from rlsys.config.placement import PlacementConfig
from rlsys.config.reward import JudgeConfig, RewardConfig
from rlsys.config.rollout import STANDING_NAME_PATTERN, RolloutConfig
from rlsys.config.rollout_modes import (
    ROLLOUT_MODES,
    AsyncMode,
    PartialMode,
    RolloutMode,
    SyncMode,
    register_rollout_mode,
)
from rlsys.config.rules import check_context_parallel
from rlsys.config.run import RunConfig, resolve_derived_settings
from rlsys.config.task import OpenEnvTaskConfig, TaskConfig, VerifiersTaskConfig
from rlsys.config.trainer import TrainerConfig
from rlsys.config.weight_sync import WeightSyncConfig

__all__ = [
    "CPU_STARTUP_TIMEOUT_S", "GPU_STARTUP_TIMEOUT_S", "ROLLOUT_MODES", "STANDING_NAME_PATTERN", "AlgorithmConfig",
    "AsyncMode", "CheckpointConfig", "ConfigError", "DataConfig", "EngineConfig", "EvalConfig", "EvalSetConfig",
    "JudgeConfig", "LoggingConfig", "LoraConfig", "ModelConfig", "OpenEnvTaskConfig", "OverlongPenaltyConfig", "PartialMode",
    "PlacementConfig", "ProfileConfig", "RewardConfig", "RolloutConfig", "RolloutMode", "RunConfig", "SamplingConfig",
    "StatusConfig", "SyncMode", "SyntheticTaskConfig", "TaskConfig", "TrainerConfig", "VerifiersTaskConfig",
    "WeightSyncConfig", "apply_override", "check_context_parallel", "dump_config", "load_config",
    "register_rollout_mode", "resolve_derived_settings",
]
