"""reward: how samples are scored (a function, or a reward service behind reward.url)."""

from __future__ import annotations

from pydantic import Field, model_validator

from rlsys.section import Section


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
    batch_size: int = Field(64, ge=1, description="reward.url: items per request.")
    max_concurrency: int = Field(4, ge=1, description="reward.url: requests in flight at once.")
    max_retries: int = Field(3, ge=0, description="reward.url: retries of a failed or timed-out request.")
    retry_backoff_s: float = Field(0.5, ge=0.0, description="reward.url: first retry delay, doubled on each retry.")

    @model_validator(mode="after")
    def _one_reward(self):
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"reward.url must be an http:// or https:// URL (got {self.url!r})")
        return self
