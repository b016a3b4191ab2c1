"""Reward calls in worker processes, each under a time limit.

A reward function that raises, returns something other than a finite number, or runs longer than
`reward.timeout_s` gives an error outcome (counted by the caller), never a crashed or hung run.
Each worker loads the function itself by its import path and bounds every call with a real-time
timer (SIGALRM in the worker's main thread, where calls run). A call the timer cannot interrupt
(stuck inside C code) is caught by a deadline on the worker's whole chunk: its calls become
errors and the pool is replaced.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import traceback
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from rlsys.interrupts import children_shielded_from_ctrl_c
from rlsys.rewards import RewardFn, load_reward_function, score


@dataclass(frozen=True)
class RewardCall:
    prompt: str
    response: str
    label: str
    metadata: dict


@dataclass(frozen=True)
class RewardOutcome:
    value: float | None = None
    error: str | None = None  # a short traceback or reason when the call gave no value


class RewardTimeout(Exception):
    """A reward call ran past reward.timeout_s."""


# The worker process's reward function, set once by `_load_in_worker` (a pool initializer).
_worker_function: RewardFn | None = None


def _load_in_worker(function_path: str, working_dir: str) -> None:
    global _worker_function
    os.chdir(working_dir)
    sys.path.insert(0, working_dir)  # as `python -m` would: reward modules beside the config import
    _worker_function = load_reward_function(function_path)


def _on_alarm(signum, frame):
    raise RewardTimeout


def score_calls(function: RewardFn, calls: list[RewardCall], timeout_s: float) -> list[RewardOutcome]:
    """Call `function` on each call in this process's main thread, each bounded by `timeout_s`."""
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    outcomes = []
    try:
        for call in calls:
            try:
                signal.setitimer(signal.ITIMER_REAL, timeout_s)
                try:
                    value = score(function, call.prompt, call.response, call.label, call.metadata)
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                outcomes.append(RewardOutcome(value=value))
            except RewardTimeout:
                outcomes.append(RewardOutcome(error=f"the reward call took longer than {timeout_s:g}s (reward.timeout_s)"))
            except Exception:  # noqa: BLE001 - a user reward function may raise anything
                outcomes.append(RewardOutcome(error=traceback.format_exc(limit=3)))
    finally:
        signal.signal(signal.SIGALRM, previous)
    return outcomes


def _score_in_worker(calls: list[RewardCall], timeout_s: float) -> list[RewardOutcome]:
    return score_calls(_worker_function, calls, timeout_s)


def _ready() -> bool:
    return True


class RewardPool:
    """`num_workers` processes scoring chunks of calls; start-up is paid once, at `start` (or the
    first call)."""

    def __init__(self, function_path: str, num_workers: int, timeout_s: float):
        self.function_path = function_path
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self._executor: ProcessPoolExecutor | None = None

    def _pool(self) -> ProcessPoolExecutor:
        if self._executor is None:
            # spawn, not fork: the driver holds Ray's and uvicorn's threads, which a fork would copy
            self._executor = ProcessPoolExecutor(
                self.num_workers, mp_context=multiprocessing.get_context("spawn"),
                initializer=_load_in_worker, initargs=(self.function_path, os.getcwd()),
            )
        return self._executor

    def start(self) -> None:
        """Launch the workers now; they import the reward function while the caller goes on (the
        run starts its engines meanwhile), instead of during the first step."""
        pool = self._pool()
        with children_shielded_from_ctrl_c():  # the pool starts its workers at submit, as it needs them
            for _ in range(self.num_workers):
                pool.submit(_ready)

    def score(self, calls: list[RewardCall]) -> list[RewardOutcome]:
        """One outcome per call, in order."""
        if not calls:
            return []
        size = -(-len(calls) // self.num_workers)
        chunks = [calls[i:i + size] for i in range(0, len(calls), size)]
        with children_shielded_from_ctrl_c():  # a replaced pool starts its workers here
            futures = [self._pool().submit(_score_in_worker, chunk, self.timeout_s) for chunk in chunks]
        outcomes, stuck = [], False
        for chunk, future in zip(chunks, futures, strict=True):
            # Chunks run side by side; one whose calls cannot all finish within their limits is stuck.
            deadline = self.timeout_s * len(chunk) + 30.0
            try:
                outcomes.extend(future.result(timeout=None if stuck else deadline))
            except FutureTimeout:
                stuck = True
                outcomes.extend(RewardOutcome(error="the reward worker did not return (stuck outside Python?); "
                                                    "it was stopped") for _ in chunk)
            except Exception as error:  # noqa: BLE001 - a worker that died (e.g. the function killed it)
                outcomes.extend(RewardOutcome(error=f"the reward worker failed: {error!r}") for _ in chunk)
                self._replace_pool()
            if stuck:
                self._replace_pool()
        return outcomes

    def _replace_pool(self) -> None:
        if self._executor is None:
            return
        for process in list(getattr(self._executor, "_processes", {}).values()):
            process.kill()  # a stuck call ignores everything gentler
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._executor = None

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None


def make_reward_scorer(config):
    """The run's scorer from its `reward` section: the reward service at reward.url, or
    reward.function in worker processes."""
    if config.url is not None:
        from rlsys.remote_reward import RemoteReward

        return RemoteReward(config.url, config.batch_size, config.timeout_s, config.max_retries,
                            config.retry_backoff_s, config.max_concurrency)
    return RewardPool(config.function, config.num_workers, config.timeout_s)
