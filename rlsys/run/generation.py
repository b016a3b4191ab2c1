"""Which way samples are made: one engine call each (the default), or the configured
rollout.generate_function (multi-turn, tools; rollout/trajectory.py); and with which sampling
parameters (`sampling_params`, the one place training's and every eval set's are built)."""

from __future__ import annotations

import inspect

from rlsys.config import RunConfig
from rlsys.plugins import PluginError, load_user_function
from rlsys.records import EncodedPrompt, Generation, SamplingParams
from rlsys.rollout.manager import RolloutManager
from rlsys.rollout.trajectory import GenerateFunction
from rlsys.run.assets import RunAssets


def sampling_params(config: RunConfig, assets: RunAssets, temperature: float, top_p: float,
                    max_new_tokens: int | None = None) -> SamplingParams:
    """What the engines sample with: the given temperature, top_p and length (default
    rollout.max_new_tokens), rollout.sampling's options and the stop rules of the run."""
    extra = config.rollout.sampling
    return SamplingParams(
        temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens or config.rollout.max_new_tokens,
        # Without its tokenizer the engine stops on token ids only (assets.stop_token_ids).
        stop=config.rollout.stop if not config.rollout.engine.skip_tokenizer_init else [],
        stop_token_ids=[*assets.stop_token_ids, *extra.stop_token_ids],
        top_k=extra.top_k, min_p=extra.min_p, repetition_penalty=extra.repetition_penalty,
        min_new_tokens=extra.min_new_tokens, ignore_eos=extra.ignore_eos,
    )


def load_generate_function(import_path: str) -> GenerateFunction:
    function = load_user_function(import_path, "rollout.generate_function")
    if not inspect.iscoroutinefunction(function):
        raise PluginError(
            f"rollout.generate_function {import_path!r} must be an async function "
            "(async def fn(prompt, ctx) -> Trajectory | None)"
        )
    try:
        inspect.signature(function).bind("prompt", "ctx")
    except TypeError as error:
        raise PluginError(f"rollout.generate_function {import_path!r} must accept (prompt, ctx): {error}") \
            from error
    return function


class SampleMaker:
    """`samples(rollout, prompts, sampling, n)`: n generations per prompt, grouped by prompt."""

    def __init__(self, config: RunConfig, tokenizer, environment=None):
        """`environment`: the run's task environment (RunAssets.environment), whose turns, if it has
        any, make the samples (a verifiers MultiTurnEnv's)."""
        self.path = config.rollout.generate_function
        self.function = load_generate_function(self.path) if self.path else None
        if environment is not None and environment.generate_function() is not None:
            self.function, self.path = environment.generate_function(), f"task {environment.describe()}"

        self.tokenizer = tokenizer
        self.tool_timeout_s = config.rollout.tool_timeout_s

    def samples(self, rollout: RolloutManager, prompts: list[EncodedPrompt], sampling: SamplingParams, n: int,
                recover: bool = True) -> list[Generation]:
        if self.function is None:
            images = [p.record.images for p in prompts]
            return rollout.generate([p.token_ids for p in prompts], sampling, n, recover=recover,
                                    images=images if any(images) else None, seeds=[p.seed for p in prompts])
        return rollout.trajectories(prompts, self.function, sampling,
                                    n, self.tokenizer, self.tool_timeout_s, recover=recover, function_path=self.path)


def trajectory_metrics(generations: list[Generation]) -> dict:
    """Turns, tool calls and tool errors per sample, and the share of response tokens the policy
    sampled (the rest were injected: tool output, markup); {} for single-turn samples."""
    if not any(g.multi_turn for g in generations):
        return {}
    count = max(len(generations), 1)
    response_tokens = sum(len(g.response_ids) for g in generations)
    policy_tokens = sum(len(g.response_ids) if g.loss_mask is None else sum(g.loss_mask) for g in generations)
    return {
        "turns_mean": sum(g.turns for g in generations) / count,
        "tool_calls_mean": sum(g.tool_calls for g in generations) / count,
        "tool_errors": sum(g.stop_reason is not None for g in generations),
        "policy_tokens_fraction": policy_tokens / max(response_tokens, 1),
    }
