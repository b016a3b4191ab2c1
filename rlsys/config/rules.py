"""The validity rules that span sections, in one place: each says which settings of two or more
sections cannot run together, refused at load (before anything starts) with what to change.

A rule within one section lives in that section (rlsys/config/*.py); a rollout mode's and a policy
loss's own rules live with them (`RolloutMode.check`, `PolicyLoss.check`) and are called from here
or from their section.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlsys.algorithms.policy_losses import POLICY_LOSSES
from rlsys.config.algorithm import AlgorithmConfig
from rlsys.config.trainer import TrainerConfig

if TYPE_CHECKING:
    from rlsys.config.data import DataConfig
    from rlsys.config.observability import ProfileConfig
    from rlsys.config.placement import PlacementConfig
    from rlsys.config.reward import RewardConfig
    from rlsys.config.rollout import RolloutConfig
    from rlsys.config.task import TaskConfig


def check_across_sections(*, data: DataConfig, rollout: RolloutConfig, trainer: TrainerConfig,
                          algorithm: AlgorithmConfig, placement: PlacementConfig, profile: ProfileConfig) -> None:
    """Every rule below, on a run config's sections (ValueError on the first broken one). The
    rollout mode's own (`RolloutMode.check`) runs beside it, in RunConfig's validator."""
    check_context_parallel(trainer, algorithm)
    check_profiled_steps(profile, trainer)
    check_routing_replay(rollout, trainer)
    check_rollout_mode(data, rollout, placement)
    check_images(data, rollout)
    check_algorithm_fits_rollout(algorithm, rollout)
    check_placement(placement, rollout, trainer)


def check_context_parallel(trainer: TrainerConfig, algorithm: AlgorithmConfig) -> None:
    """What context parallelism cannot do yet, refused before anything starts: each CP rank holds
    two chunks of a sequence, so a per-sequence sum (a loss's `whole_sequence`, as gspo's sequence
    ratio, or a sequence-level correction) would need one more collective inside the loss."""
    if trainer.context_parallel_size == 1:
        return
    if not trainer.packing:
        raise ValueError("trainer.context_parallel_size > 1 needs trainer.packing=true (each rank holds chunks of "
                         "packed sequences)")
    if algorithm.policy_loss.whole_sequence:
        token_level = [name for name, loss in POLICY_LOSSES.items() if not loss.whole_sequence]
        raise ValueError(f"algorithm.policy_loss={algorithm.policy_loss.name} takes a sum over each whole sequence, "
                         "which trainer.context_parallel_size > 1 splits over ranks: not supported yet; use a "
                         f"token-level loss ({', '.join(token_level)}) or context_parallel_size=1")
    whole = [c.name for c in algorithm.corrections or [] if c.whole_sequence()]
    if whole:
        raise ValueError(f"algorithm.corrections {', '.join(whole)} take a sum over each whole sequence, which "
                         "trainer.context_parallel_size > 1 splits over ranks: not supported yet; use token-level "
                         "corrections (importance_sampling with level: token, icepop)")


def check_profiled_steps(profile: ProfileConfig, trainer: TrainerConfig) -> None:
    steps, total = profile.steps, trainer.total_steps
    if steps is not None and steps[0] >= total:
        raise ValueError(f"profile.steps starts at step {steps[0]}, but the run's steps are 0..{total - 1} "
                         f"(trainer.total_steps={total})")


def check_routing_replay(rollout: RolloutConfig, trainer: TrainerConfig) -> None:
    if rollout.routing_replay != "off" and trainer.context_parallel_size > 1:
        raise ValueError("rollout.routing_replay with trainer.context_parallel_size > 1 is not supported yet (each "
                         "rank holds chunks of a sequence, the routes are laid out per whole sequence); use "
                         "context_parallel_size=1")


def check_rollout_mode(data: DataConfig, rollout: RolloutConfig, placement: PlacementConfig) -> None:
    """What the rollout mode declares it cannot do (rlsys/config/rollout_modes.py), against the rest."""
    mode = rollout.mode
    if mode.overlaps_training and placement.mode == "colocated":
        raise ValueError(f"rollout.mode {mode.type} overlaps generation with training, which needs engines and "
                         "trainers on their own devices: set placement.mode=disaggregated")
    if not mode.takes_generate_function and rollout.generate_function:
        raise ValueError(f"rollout.mode {mode.type} cannot build samples with rollout.generate_function "
                         f"({mode.why_not}; a generate function's trajectories, with tools and several turns, cannot "
                         "be): use another mode or no generate function")
    if not mode.takes_images and data.has_images:
        raise ValueError(f"rollout.mode {mode.type} with images (a vision-language model's data) is not supported "
                         f"yet ({mode.why_not}, which would reach the engine without the prompt's images)")


def check_images(data: DataConfig, rollout: RolloutConfig) -> None:
    # ctx.generate of a generate function sends token ids alone: a multi-turn request would drop its images.
    if data.has_images and rollout.generate_function:
        raise ValueError("rollout.generate_function with images (a vision-language model's data) is not supported "
                         "yet: ctx.generate sends token ids only; use the default generation")


def check_algorithm_fits_rollout(algorithm: AlgorithmConfig, rollout: RolloutConfig) -> None:
    if algorithm.overlong_penalty and algorithm.overlong_penalty.buffer_tokens > rollout.max_new_tokens:
        raise ValueError(f"algorithm.overlong_penalty.buffer_tokens ({algorithm.overlong_penalty.buffer_tokens}) "
                         f"exceeds rollout.max_new_tokens ({rollout.max_new_tokens})")
    if algorithm.mask_truncated and rollout.sampling.ignore_eos:
        raise ValueError("algorithm.mask_truncated with rollout.sampling.ignore_eos would mask every response "
                         "(all of them reach max_new_tokens); use one or the other")


def check_placement(placement: PlacementConfig, rollout: RolloutConfig, trainer: TrainerConfig) -> None:
    if placement.mode == "colocated" and rollout.num_engines > trainer.num_ranks:
        raise ValueError(f"colocated placement puts engine i beside trainer rank i, so rollout.num_engines "
                         f"({rollout.num_engines}) must be <= trainer.num_ranks ({trainer.num_ranks})")
    if placement.mode == "colocated" and rollout.engine.tp_size > 1:
        # Each trainer rank hands its weights to the engine on its own GPU by IPC handle; an engine
        # spread over several GPUs would need one handle per GPU, from the trainer rank on each of
        # them, which colocated placement does not lay out.
        raise ValueError(f"colocated placement runs each engine on its trainer rank's GPU, so rollout.engine.tp_size "
                         f"must be 1 (got {rollout.engine.tp_size}); use placement.mode=disaggregated for "
                         "tensor-parallel engines")


DEFAULT_REWARD_FUNCTION = "rlsys.rewards:exact_match"


def check_task(task: TaskConfig, data: DataConfig, reward: RewardConfig, rollout: RolloutConfig) -> None:
    """Where the prompts, the reward and the turns come from: one source of each. A verifiers
    environment brings its dataset, its rubric and (multi-turn) its turns; an OpenEnv environment
    its reward and turns, on the data section's prompts."""
    has_data = data.train_path is not None or data.synthetic is not None
    if task.verifiers is not None:
        if has_data:
            raise ValueError("task.verifiers brings its own dataset: leave data.train_path and data.synthetic unset "
                             "(data.prompts_per_step still counts the prompts of a step)")
        if data.eval_path is not None or data.eval_fraction > 0:
            raise ValueError("task.verifiers: the eval prompts are the environment's eval_dataset (task.verifiers."
                             "num_eval), not data.eval_path or data.eval_fraction")
        if data.system_prompt is not None:
            raise ValueError("task.verifiers: the environment's system_prompt is used; leave data.system_prompt unset")
    elif not has_data:
        raise ValueError("set exactly one of data.train_path, data.synthetic or task.verifiers (where the prompts "
                         "come from)")
    if task.is_set:
        which = "task.verifiers (its rubric)" if task.verifiers is not None else "task.openenv (its step rewards)"
        if reward.url is not None or reward.judge is not None or reward.function != DEFAULT_REWARD_FUNCTION:
            raise ValueError(f"the reward comes from {which}: leave reward.function, reward.url and reward.judge "
                             "unset")
        if rollout.generate_function is not None:
            raise ValueError(f"the turns come from {which.split()[0]}: leave rollout.generate_function unset")
