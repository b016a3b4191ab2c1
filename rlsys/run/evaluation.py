"""Evaluation: the data section's held-out prompts (metrics eval_*) and the named sets of
eval.datasets (metrics eval_NAME_*), each every its interval steps and at the last step; `rlsys
eval` runs them all once, on a checkpoint or a model, with no trainer."""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import comb

from rlsys.algorithms.samples import Scorer, generation_text, reward_call
from rlsys.config import RunConfig
from rlsys.observability.samples import shown_samples
from rlsys.records import EncodedPrompt, SamplingParams
from rlsys.rewards.pool import make_reward_scorer
from rlsys.rollout.manager import RolloutManager
from rlsys.rollout.seeds import eval_prompt_seed
from rlsys.run.assets import RunAssets
from rlsys.run.generation import SampleMaker, sampling_params


def pass_at_k(n: int, correct: int, k: int) -> float:
    """The unbiased pass@k of one prompt from n answers of which `correct` succeeded: the chance
    that k answers drawn from the n without replacement hold at least one success,
    1 - C(n - c, k) / C(n, k) (Chen et al., 2021, "Evaluating Large Language Models Trained on Code")."""
    if not 1 <= k <= n or not 0 <= correct <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= correct <= n (n={n}, correct={correct}, k={k})")
    return 1.0 - comb(n - correct, k) / comb(n, k)


@dataclass
class EvalSet:
    """What one eval set is and how it is run. `name` None: the data section's eval prompts."""

    name: str | None
    prompts: list[EncodedPrompt]
    sampling: SamplingParams
    n_samples: int
    interval: int
    reward_function: str | None = None  # None: the run's reward
    pass_k: tuple[int, ...] = ()
    success_threshold: float = 1.0

    @property
    def prefix(self) -> str:
        return "eval_" if self.name is None else f"eval_{self.name}_"

    def due(self, step: int, last_step: int) -> bool:
        return bool(self.prompts) and (step % self.interval == 0 or step == last_step)


def eval_sets(config: RunConfig, assets: RunAssets) -> list[EvalSet]:
    """The run's eval sets: the data section's eval prompts (one answer each at eval.temperature),
    then eval.datasets in order."""
    default_prompts = assets.eval[: config.eval.max_prompts] if config.eval.max_prompts else assets.eval
    sets = [EvalSet(None, _seeded(default_prompts, config.seed, None),
                    sampling_params(config, assets, config.eval.temperature, 1.0), 1, config.eval.interval)]
    for loaded in assets.eval_sets:
        c = loaded.config
        sets.append(EvalSet(c.name, _seeded(loaded.prompts, config.seed, c.name),
                            sampling_params(config, assets, c.temperature, c.top_p, c.max_new_tokens), c.n_samples,
                            c.interval or config.eval.interval, c.reward_function, tuple(c.pass_k),
                            c.success_threshold))
    return sets


def _seeded(prompts: list[EncodedPrompt], run_seed: int, name: str | None) -> list[EncodedPrompt]:
    """The set's prompts with their sampling seeds (rollout/seeds.py): the same at every eval of the
    run and in `rlsys eval`, so that two evals differ by the weights, not by the draw."""
    return [replace(prompt, seed=eval_prompt_seed(run_seed, name, number)) for number, prompt in enumerate(prompts)]


def set_metrics(eval_set: EvalSet, generations, rewards: list[float], errors: int) -> dict[str, float]:
    """An eval set's metrics from its answers (n per prompt, grouped prompt by prompt) and their
    rewards (0 where the reward failed): reward_mean (pass@1 averaged over the n), pass_at_K, mean
    response length, the share of answers cut at max_new_tokens, and the failed rewards."""
    n, count = eval_set.n_samples, max(len(rewards), 1)
    metrics = {
        "reward_mean": sum(rewards) / count,
        "reward_errors": errors,
        "response_len_mean": sum(len(g.response_ids) for g in generations) / count,
        "truncated_fraction": sum(g.finish_reason == "length" for g in generations) / count,
    }
    solved = [sum(r >= eval_set.success_threshold for r in rewards[i:i + n]) for i in range(0, len(rewards), n)]
    for k in eval_set.pass_k:
        metrics[f"pass_at_{k}"] = sum(pass_at_k(n, c, k) for c in solved) / max(len(solved), 1)
    return {eval_set.prefix + key: value for key, value in metrics.items()}


def metrics_by_set(metrics: dict[str, float], names: list[str]) -> dict[str | None, dict[str, float]]:
    """Eval metrics grouped by set, each under its own name without the set's prefix: None for the
    data section's eval prompts (eval_KEY), then each named set (eval_NAME_KEY). A key goes to the
    set with the longest matching prefix (sets "a" and "a_b" both exist: eval_a_b_* is a_b's)."""
    prefixes = sorted([(None, "eval_")] + [(name, f"eval_{name}_") for name in names], key=lambda p: -len(p[1]))
    grouped: dict[str | None, dict[str, float]] = {None: {}, **{name: {} for name in names}}
    for key, value in metrics.items():
        for name, prefix in prefixes:
            if key.startswith(prefix):
                grouped[name][key.removeprefix(prefix)] = value
                break
    return grouped


class Evaluator:
    """Runs the eval sets that are due against the engines' current weights. A set with a reward
    function of its own scores in a worker pool of its own (started with the first use, closed by
    `close`); the others share the run's scorer."""

    def __init__(self, config: RunConfig, assets: RunAssets, rollout: RolloutManager, scorer: Scorer,
                 maker: SampleMaker):
        self.sets = eval_sets(config, assets)
        self.last_step = config.trainer.total_steps - 1
        self.tokenizer = assets.tokenizer
        self.rollout = rollout
        self.scorer = scorer
        self.maker = maker
        self._reward_config = config.reward
        self._own_scorers: dict[str, object] = {}
        self.samples_per_set = config.logging.samples_per_step
        self.samples: list[dict] = []  # the last `evaluate`'s answers to show (rlsys/observability/samples.py)

    def due(self, step: int) -> bool:
        return any(s.due(step, self.last_step) for s in self.sets)

    def evaluate(self, step: int | None = None) -> dict[str, float]:
        """The metrics of every set due at `step` (None: every set)."""
        metrics: dict[str, float] = {}
        self.samples = []
        for eval_set in self.sets:
            if eval_set.prompts and (step is None or eval_set.due(step, self.last_step)):
                metrics.update(self.evaluate_set(eval_set, step or 0))
        return metrics

    def evaluate_set(self, eval_set: EvalSet, step: int = 0) -> dict[str, float]:
        """n answers per prompt; a prompt whose reward fails scores 0 and is counted in reward_errors.
        The first answers of the first prompts are kept to show (`samples`)."""
        generations = self.maker.samples(self.rollout, eval_set.prompts, eval_set.sampling, n=eval_set.n_samples)
        records = [p.record for p in eval_set.prompts for _ in range(eval_set.n_samples)]
        calls = [reward_call(r, g, generation_text(self.tokenizer, g, self._reward_config.skip_special_tokens))
                 for r, g in zip(records, generations, strict=True)]
        outcomes = self._scorer_for(eval_set.reward_function)(calls)
        rewards = [o.value if o.error is None else 0.0 for o in outcomes]
        self.samples += shown_samples(step, "eval" if eval_set.name is None else f"eval:{eval_set.name}",
                                      [r.prompt for r in records], [c.response for c in calls],
                                      [o.value for o in outcomes], [g.finish_reason for g in generations],
                                      [len(g.response_ids) for g in generations], eval_set.n_samples,
                                      self.samples_per_set, [r.images for r in records])
        return set_metrics(eval_set, generations, rewards, sum(o.error is not None for o in outcomes))

    def _scorer_for(self, function: str | None) -> Scorer:
        if function is None:
            return self.scorer
        if function not in self._own_scorers:
            pool = make_reward_scorer(self._reward_config.model_copy(update={"function": function, "url": None}))
            pool.start()
            self._own_scorers[function] = pool
        return self._own_scorers[function].score

    def close(self) -> None:
        for pool in self._own_scorers.values():
            pool.close()
        self._own_scorers.clear()
