"""Greedy evaluation on the held-out prompts, every `eval.interval` steps and at the last step."""

from __future__ import annotations

from rlsys.algorithms.samples import Scorer, generation_text, reward_call
from rlsys.config import RunConfig
from rlsys.records import SamplingParams
from rlsys.rollout.manager import RolloutManager
from rlsys.run.assets import RunAssets
from rlsys.run.generation import SampleMaker


def sampling_params(config: RunConfig, assets: RunAssets, temperature: float, top_p: float) -> SamplingParams:
    extra = config.rollout.sampling
    return SamplingParams(
        temperature=temperature, top_p=top_p, max_new_tokens=config.rollout.max_new_tokens,
        # Without its tokenizer the engine stops on token ids only (assets.stop_token_ids).
        stop=config.rollout.stop if not config.rollout.engine.skip_tokenizer_init else [],
        stop_token_ids=[*assets.stop_token_ids, *extra.stop_token_ids],
        top_k=extra.top_k, min_p=extra.min_p, repetition_penalty=extra.repetition_penalty,
        min_new_tokens=extra.min_new_tokens, ignore_eos=extra.ignore_eos,
    )


class Evaluator:
    def __init__(self, config: RunConfig, assets: RunAssets, rollout: RolloutManager, scorer: Scorer,
                 maker: SampleMaker):
        self.interval = config.eval.interval
        self.last_step = config.trainer.total_steps - 1
        self.prompts = assets.eval[: config.eval.max_prompts] if config.eval.max_prompts else assets.eval
        self.sampling = sampling_params(config, assets, config.eval.temperature, 1.0)
        self.tokenizer = assets.tokenizer
        self.rollout = rollout
        self.scorer = scorer
        self.maker = maker

    def due(self, step: int) -> bool:
        return bool(self.prompts) and (step % self.interval == 0 or step == self.last_step)

    def evaluate(self) -> dict[str, float]:
        """Mean reward of one greedy (eval.temperature) answer per eval prompt. A prompt whose
        reward fails scores 0 and is counted in `eval_reward_errors`."""
        generations = self.maker.samples(self.rollout, self.prompts, self.sampling, n=1)
        calls = [reward_call(p.record, g, generation_text(self.tokenizer, g))
                 for p, g in zip(self.prompts, generations, strict=True)]
        outcomes = self.scorer(calls)
        rewards = [o.value if o.error is None else 0.0 for o in outcomes]
        return {"eval_reward_mean": sum(rewards) / max(len(rewards), 1),
                "eval_reward_errors": sum(o.error is not None for o in outcomes)}
