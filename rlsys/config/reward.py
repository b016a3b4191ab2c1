"""reward: how samples are scored (a function, or a reward service behind reward.url)."""

from __future__ import annotations

import string
from typing import Literal

from pydantic import Field, model_validator

from rlsys.config.engine import EngineConfig
from rlsys.section import Section

JUDGE_FIELDS = ("prompt", "response", "label")


class JudgeConfig(Section):
    """A frozen model that grades each sample, served by the run on SGLang engines of its own: never
    synced, restarted like a policy engine when one dies (rlsys/rewards/judge.py)."""

    model: str = Field(description="The judge model's directory (weights, config.json, its tokenizer).")
    engines: int = Field(1, ge=1, description="SGLang engines serving the judge (its requests dealt among them).")
    prompt: str = Field(
        description="What the judge reads: {prompt}, {response} and {label} are replaced by the sample's (write {{ "
        "and }} for braces); a user turn of the judge's chat template when chat_template is on.",
    )
    chat_template: bool = Field(False, description="Render the judge prompt as a user turn of the judge tokenizer's "
                                "chat template (it must have one); off: the prompt's text is the judge's input.")
    parse: Literal["logprob_yes", "score"] = Field(
        "logprob_yes", description="logprob_yes: the reward is the judge's probability of `yes` against `no` as the "
        "next token, p(yes) / (p(yes) + p(no)), from the engine's log-probs of both (nothing is sampled). score: "
        "the judge writes (greedy, up to max_new_tokens) and the first number in its text is the reward; a text "
        "without one is a reward error.",
    )
    yes: str = Field("yes", description="logprob_yes: the answer that means right (one token of the judge's).")
    no: str = Field("no", description="logprob_yes: the answer that means wrong (one token of the judge's).")
    max_new_tokens: int = Field(8, ge=1, description="parse: score: tokens the judge may write.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="The judge's SGLang servers (fields as "
                                 "rollout.engine's).")

    @model_validator(mode="after")
    def _prompt_fields(self):
        try:
            named = {name for _, name, _, _ in string.Formatter().parse(self.prompt) if name is not None}
        except ValueError as error:
            raise ValueError(f"reward.judge.prompt is not a format string: {error} (write {{{{ and }}}} for "
                             "braces)") from None
        if named - set(JUDGE_FIELDS):
            raise ValueError(f"reward.judge.prompt names {sorted(named - set(JUDGE_FIELDS))}; it may name only "
                             + ", ".join("{" + name + "}" for name in JUDGE_FIELDS) + " (write {{ and }} for braces)")
        if self.parse == "logprob_yes" and self.yes == self.no:
            raise ValueError("reward.judge.yes and reward.judge.no must differ")
        return self


class RewardConfig(Section):
    function: str = Field(
        "rlsys.rewards:exact_match",
        description="'package.module:function' or 'path/to/file.py:function' (relative to the working "
        "directory) of fn(prompt, response, label, metadata) -> float.",
    )
    skip_special_tokens: bool = Field(
        True, description="The response the reward (and each eval set's) reads: decoded up to the first EOS "
        "without special tokens (a pad, unk or BOS token, a stop token other than the tokenizer's EOS), as TRL, "
        "verl and slime decode it; false: with them, so a stray <pad> inside an answer makes it another answer. "
        "A multi-turn trajectory is read whole with its special tokens (they mark its turns) either way.",
    )
    max_error_fraction: float = Field(
        0.5, ge=0.0, le=1.0,
        description="Fail the run when more than this fraction of a step's rewards fail.",
    )
    timeout_s: float = Field(
        60.0, gt=0.0, description="A reward call running longer than this is stopped and counted as an error.",
    )
    num_workers: int = Field(1, ge=1, description="Processes that compute rewards (side by side).")
    url: str | None = Field(
        None, description="A reward service; when set, reward.function is not used. Batches are POSTed here as "
        '{"items": [{prompt, response, label, metadata}]} and {"scores": [...]} comes back (rlsys/rewards/remote.py).',
    )
    judge: JudgeConfig | None = Field(
        None, description="Grade each sample with a frozen judge model on SGLang engines the run starts for it "
        "(reward.function and reward.url are then not used; docs/bring-your-own-task.md, use a judge).",
    )
    batch_size: int = Field(64, ge=1, description="reward.url: items per request.")
    max_concurrency: int = Field(4, ge=1, description="reward.url: requests in flight at once.")
    max_retries: int = Field(3, ge=0, description="reward.url: retries of a failed or timed-out request.")
    retry_backoff_s: float = Field(0.5, ge=0.0, description="reward.url: first retry delay, doubled on each retry.")

    @model_validator(mode="after")
    def _one_reward(self):
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"reward.url must be an http:// or https:// URL (got {self.url!r})")
        if self.url is not None and self.judge is not None:
            raise ValueError("set at most one of reward.url and reward.judge")
        return self
