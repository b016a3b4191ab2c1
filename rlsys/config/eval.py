"""eval: evaluation on the held-out prompts and on named eval sets."""

from __future__ import annotations

from pydantic import Field, model_validator

from rlsys.section import Section


class EvalSetConfig(Section):
    """One named eval set (eval.datasets): its prompts, its reward, how it is sampled and when."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$", description="Its metrics are eval_NAME_reward_mean, "
                      "eval_NAME_pass_at_K, ... (lower case letters, digits and _).")
    path: str = Field(description="Its prompts, in any format data.train_path takes (.jsonl, .parquet, .json, .csv, "
                      "a saved dataset directory).")
    split: str = Field("test", description="The split of a saved DatasetDict that path names.")
    prompt_key: str | None = Field(None, description="The field holding the prompt (default: data.prompt_key).")
    label_key: str | None = Field(None, description="The field holding the label (default: data.label_key).")
    metadata_keys: list[str] | None = Field(
        None, description="Fields passed to the reward as metadata (default: data.metadata_keys).")
    reward_function: str | None = Field(
        None, description="Its reward, as reward.function spells one (default: the run's reward: reward.function, "
        "or reward.url when set).",
    )
    n_samples: int = Field(1, ge=1, description="Answers sampled per prompt; reward_mean is pass@1 averaged over them.")
    pass_k: list[int] = Field(default_factory=list, description="The k's of pass@k to report (each at most "
                              "n_samples): the unbiased estimator from n_samples answers per prompt.")
    success_threshold: float = Field(1.0, description="An answer counts as solved for pass@k when its reward is "
                                     "at least this.")
    temperature: float = Field(0.0, ge=0.0, description="Sampling temperature (0: greedy; n_samples > 1 wants > 0).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling of its answers.")
    max_new_tokens: int | None = Field(None, ge=1, description="Longest answer (default: rollout.max_new_tokens).")
    interval: int | None = Field(None, ge=1, description="Evaluate every this many steps, and at the last step "
                                 "(default: eval.interval).")
    max_prompts: int | None = Field(None, ge=1, description="Evaluate only its first this many prompts.")

    @model_validator(mode="after")
    def _k_within_n(self):
        if too_large := [k for k in self.pass_k if not 1 <= k <= self.n_samples]:
            raise ValueError(f"eval set {self.name!r}: pass_k {too_large} must lie in 1..n_samples "
                             f"({self.n_samples}); pass@k needs at least k answers per prompt")
        return self


class EvalConfig(Section):
    interval: int = Field(10, ge=1, description="Evaluate every this many steps (and at the last step).")
    temperature: float = Field(0.0, ge=0.0, description="Sampling temperature of eval answers (0: greedy).")
    max_prompts: int | None = Field(None, ge=1, description="Evaluate only the first this many eval prompts.")
    stop_at_reward: float | None = Field(
        None, description="Finish the run at the end of the first step whose eval of the data "
        "section's eval prompts (eval_reward_mean) reaches this, as if it were trainer.total_steps' last (checkpointed when "
        "checkpoint.interval is set); None: run every step.",
    )
    datasets: list[EvalSetConfig] = Field(
        default_factory=list, description="Named eval sets besides the data section's eval prompts, each with its "
        "file, reward, sampling and interval (rlsys/run/evaluation.py); `rlsys eval` runs them on a checkpoint.",
    )

    @model_validator(mode="after")
    def _names_unique(self):
        names = [s.name for s in self.datasets]
        if repeated := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"eval.datasets: each set needs a name of its own ({', '.join(repeated)} repeated)")
        return self
