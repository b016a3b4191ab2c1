"""Greedy evaluation on the held-out prompts, every `eval.interval` steps and at the last step."""

from __future__ import annotations

from rlsys.assets import RunAssets
from rlsys.config import RunConfig
from rlsys.rollout.engine import SamplingParams
from rlsys.rollout.manager import RolloutManager
from rlsys.samples import response_text


def sampling_params(config: RunConfig, assets: RunAssets, temperature: float, top_p: float) -> SamplingParams:
    return SamplingParams(
        temperature=temperature, top_p=top_p, max_new_tokens=config.rollout.max_new_tokens,
        # Without its tokenizer the engine stops on token ids only (assets.stop_token_ids).
        stop=config.rollout.stop if not config.rollout.engine.skip_tokenizer_init else [],
        stop_token_ids=assets.stop_token_ids,
    )


class Evaluator:
    def __init__(self, config: RunConfig, assets: RunAssets, rollout: RolloutManager):
        self.interval = config.eval.interval
        self.last_step = config.trainer.total_steps - 1
        self.prompts = assets.eval[: config.eval.max_prompts] if config.eval.max_prompts else assets.eval
        self.sampling = sampling_params(config, assets, config.eval.temperature, 1.0)
        self.assets = assets
        self.rollout = rollout

    def due(self, step: int) -> bool:
        return bool(self.prompts) and (step % self.interval == 0 or step == self.last_step)

    def evaluate(self) -> float:
        """Mean reward of one greedy (eval.temperature) answer per eval prompt."""
        generations = self.rollout.generate([p.token_ids for p in self.prompts], self.sampling, n=1)
        rewards = []
        for prompt, generation in zip(self.prompts, generations, strict=True):
            text = response_text(self.assets.tokenizer, generation.response_ids)
            record = prompt.record
            try:
                rewards.append(self.assets.reward_fn(record.prompt, text, record.label, record.metadata))
            except Exception:  # noqa: BLE001 - an eval sample whose reward raises scores 0
                rewards.append(0.0)
        return sum(rewards) / max(len(rewards), 1)
