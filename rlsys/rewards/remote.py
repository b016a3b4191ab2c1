"""Rewards from a reward service: batches POSTed to `reward.url`, scores back as JSON.

Request:  {"items": [{"prompt": ..., "response": ..., "label": ..., "metadata": {...}}, ...]}
Answer:   {"scores": [s_0, s_1, ...]}  (or a bare list), one per item, in order; each a number, or
          null / {"error": "why"} for an item the service could not score (a counted error).

Batches go out concurrently (at most `max_concurrency` at a time). A connection failure, a
timeout, HTTP 429 or a 5xx is retried with exponential backoff (`retry_backoff_s` * 2^attempt,
`max_retries` times). A service that cannot be reached at all stops the run with a message
naming the URL; one that keeps timing out or failing turns its batches into counted errors (the
run then stops on reward.max_error_fraction). An answer that breaks the protocol stops the run.
"""

from __future__ import annotations

import asyncio

import httpx

from rlsys.errors import RunFailed
from rlsys.records import RewardCall, RewardOutcome
from rlsys.rewards.loading import REWARD_MAGNITUDE_LIMIT, reward_value_problem


class RewardServiceError(RunFailed):
    """The reward service cannot be reached or answered outside the protocol."""


class _Retryable(Exception):
    def __init__(self, reason: str, unreachable: bool):
        super().__init__(reason)
        self.unreachable = unreachable


class RemoteReward:
    """Same interface as RewardPool (start / score / close)."""

    def __init__(self, url: str, batch_size: int, timeout_s: float, max_retries: int, retry_backoff_s: float,
                 max_concurrency: int):
        self.url = url
        self.batch_size = batch_size
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.max_concurrency = max_concurrency

    def start(self) -> None:
        """Nothing to start: each `score` opens its own connections."""

    def close(self) -> None:
        pass

    def score(self, calls: list[RewardCall]) -> list[RewardOutcome]:
        """One outcome per call, in order."""
        if not calls:
            return []
        return asyncio.run(self._score_all(calls))

    async def _score_all(self, calls: list[RewardCall]) -> list[RewardOutcome]:
        batches = [calls[i:i + self.batch_size] for i in range(0, len(calls), self.batch_size)]
        limit = asyncio.Semaphore(self.max_concurrency)
        async with httpx.AsyncClient(timeout=self.timeout_s) as client:
            async def one(batch):
                async with limit:
                    return await self._score_batch(client, batch)
            results = await asyncio.gather(*(one(batch) for batch in batches))
        return [outcome for result in results for outcome in result]

    async def _score_batch(self, client: httpx.AsyncClient, batch: list[RewardCall]) -> list[RewardOutcome]:
        payload = {"items": [{"prompt": c.prompt, "response": c.response, "label": c.label, "metadata": c.metadata}
                             for c in batch]}
        for attempt in range(self.max_retries + 1):
            try:
                return self._outcomes(await self._post(client, payload), len(batch))
            except _Retryable as error:
                if attempt == self.max_retries:
                    if error.unreachable:
                        raise RewardServiceError(
                            f"reward.url {self.url} cannot be reached ({error}) after {attempt + 1} attempts; "
                            "is the reward service running?") from None
                    return [RewardOutcome(error=f"reward service {self.url}: {error} "
                                                f"(after {attempt + 1} attempts)")] * len(batch)
                await asyncio.sleep(self.retry_backoff_s * 2**attempt)
        raise AssertionError("unreachable")

    async def _post(self, client: httpx.AsyncClient, payload: dict):
        try:
            response = await client.post(self.url, json=payload)
        except httpx.TimeoutException:
            raise _Retryable(f"no answer within {self.timeout_s:g}s (reward.timeout_s)", unreachable=False) from None
        except httpx.TransportError as error:
            raise _Retryable(f"{type(error).__name__}: {error}", unreachable=True) from None
        if response.status_code == 429 or response.status_code >= 500:
            raise _Retryable(f"HTTP {response.status_code}: {response.text[:200]}", unreachable=False)
        if response.status_code >= 400:
            raise RewardServiceError(f"reward.url {self.url} refused the request: HTTP {response.status_code}: "
                                     f"{response.text[:500]}")
        try:
            return response.json()
        except ValueError:
            raise RewardServiceError(f"reward.url {self.url} answered with something that is not JSON: "
                                     f"{response.text[:200]!r}") from None

    def _outcomes(self, answer, expected: int) -> list[RewardOutcome]:
        scores = answer.get("scores") if isinstance(answer, dict) else answer
        if not isinstance(scores, list) or len(scores) != expected:
            raise RewardServiceError(
                f"reward.url {self.url} must answer {{\"scores\": [...]}} with {expected} scores, one per item; "
                f"got {str(answer)[:200]}")
        return [_outcome(score) for score in scores]


def _outcome(score) -> RewardOutcome:
    if isinstance(score, dict) and "error" in score:
        return RewardOutcome(error=f"the reward service could not score it: {score['error']}")
    if score is None:
        return RewardOutcome(error="the reward service gave no score (null)")
    problem = reward_value_problem(score)
    if problem is not None:
        return RewardOutcome(error=f"the reward service returned {score!r}: {problem}; scores must be finite "
                                   f"numbers within +-{REWARD_MAGNITUDE_LIMIT:g}")
    return RewardOutcome(value=float(score))
