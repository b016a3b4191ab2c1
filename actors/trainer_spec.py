"""TrainerSpec: what a trainer rank is configured with, made from the run config's own sections."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlsys.config import AlgorithmConfig, ModelConfig, RolloutConfig, RunConfig, TrainerConfig, resolve_derived_settings


@dataclass(frozen=True)
class TrainerSpec:
    """A trainer rank's configuration: the run config's own sections, nothing copied. Its algorithm
    section is resolved (rlsys/config/run.py `resolve_derived_settings`); one given unresolved (a
    standalone group) takes the rollout section's defaults."""

    model: ModelConfig
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    temperature: float = 1.0  # the rollout's: trainer log-probs are of the distribution it sampled
    seed: int = 0
    has_gpu: bool = False  # decided by the driver from the cluster's resources (rlsys/system/backend.py)
    # Processes of the run computing on a rank's node while it trains (Topology.cpu_sharers); the
    # rank's threads are its node's cores over this. None (standalone groups): one thread.
    cpu_sharers: int | None = None
    # rollout.routing_replay == "rollout": every forward routes by the engine's experts (actors/routing_replay.py)
    routing_replay: bool = False
    # The rank sleeps between train phases (a colocated run: trainer.sleeps_between_steps): its
    # host arena is prepared at setup.
    sleeps: bool = False
    # The KL term's reference keeps its fp32 shards on the device (trainer.reference_placement, auto as the
    # memory plan resolves it: TrainerGroup's judge_model), else on the host, streamed each forward.
    reference_on_device: bool = False

    def __post_init__(self):
        if self.algorithm.loss_norm_tokens is None or self.algorithm.corrections is None:
            rollout = RolloutConfig()
            object.__setattr__(self, "algorithm", self.algorithm.resolved(rollout.max_new_tokens, off_policy=False))

    @classmethod
    def from_config(cls, config: RunConfig, has_gpu: bool, cpu_sharers: int | None = None) -> TrainerSpec:
        resolved = resolve_derived_settings(config)  # (a no-op for a loaded config: load_config resolved it)
        return cls(config.model, config.trainer, resolved.algorithm, config.rollout.temperature, seed=config.seed,
                   has_gpu=has_gpu, cpu_sharers=cpu_sharers, routing_replay=config.rollout.routing_replay == "rollout",
                   sleeps=config.trainer.sleeps_between_steps(config.placement.mode == "colocated", has_gpu),
                   reference_on_device=config.trainer.reference_placement == "device")

    def threads(self, node_cores: int) -> int:
        if self.trainer.threads_per_rank is not None:
            return self.trainer.threads_per_rank
        return max(1, node_cores // self.cpu_sharers) if self.cpu_sharers else 1

    @property
    def needs_reference(self) -> bool:
        return self.algorithm.use_kl_loss or self.algorithm.kl_in_reward

    @property
    def loss_norm_tokens(self) -> int:
        """The constant of seq-mean-token-sum-norm (algorithm.loss_norm_tokens, resolved)."""
        return self.algorithm.loss_norm_tokens

    @property
    def corrects(self) -> bool:
        """Whether the run has rollout corrections (algorithm.corrections, resolved)."""
        return bool(self.algorithm.corrections)


