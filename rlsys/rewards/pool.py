"""Reward calls in worker processes, each under a time limit.

A reward function that raises, returns something other than a finite number, or runs longer than
`reward.timeout_s` gives an error outcome (counted by the caller), never a crashed or hung run.
Each worker loads the function itself by its import path and bounds every call with a real-time
timer (SIGALRM in the worker's main thread, where calls run). A call the timer cannot interrupt
(stuck inside C code) is caught by a deadline on the worker's whole chunk: its calls become
errors and the pool is replaced. A call that ends its worker process (`os._exit`, a segfault, the
OOM killer) is found from the workers' progress, counted as that one call's error, and the pool
is restarted; the other calls are scored again by the fresh workers.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from concurrent.futures import CancelledError, ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool

from rlsys.errors import RunFailed
from rlsys.records import RewardCall, RewardOutcome
from rlsys.rewards.loading import RewardFn, load_reward_function, score
from rlsys.system.interrupts import children_shielded_from_stop_signals
from rlsys.system.working_dir import working_directory

# How long idle workers get to take the executor's exit request at close before they are killed.
CLOSE_GRACE_S = 10.0

logger = logging.getLogger(__name__)


class RewardTimeout(Exception):
    """A reward call ran past reward.timeout_s."""


# The worker process's reward function and the pool's progress board, set once by
# `_load_in_worker` (a pool initializer).
_worker_function: RewardFn | None = None
_progress = None


def _load_in_worker(function_path: str, working_dir: str, progress) -> None:
    global _worker_function, _progress
    _progress = progress
    os.chdir(working_dir)
    sys.path.insert(0, working_dir)  # as `python -m` would: reward modules beside the config import
    _worker_function = load_reward_function(function_path)


def _on_alarm(signum, frame):
    raise RewardTimeout


def score_calls(function: RewardFn, calls: list[RewardCall], timeout_s: float,
                slot: int | None = None) -> list[RewardOutcome]:
    """Call `function` on each call in this process's main thread, each bounded by `timeout_s`.
    With a `slot`, the pool's progress board shows how many calls have started and this process's pid."""
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    outcomes = []
    try:
        for started, call in enumerate(calls, start=1):
            if slot is not None:  # before the call: should it end this process, the pool knows which call did
                _progress[2 * slot], _progress[2 * slot + 1] = os.getpid(), started
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


def _score_in_worker(calls: list[RewardCall], timeout_s: float, slot: int) -> list[RewardOutcome]:
    return score_calls(_worker_function, calls, timeout_s, slot)


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
        # Per chunk slot, written by the worker on it: its pid and how many of the chunk's calls it
        # has started. When a worker dies, this is what says which call it was running.
        self._progress = None
        self._lock = threading.Lock()  # one `score` at a time: each owns the progress slots while it runs
        self._told_of_a_killing_call = False
        # The pool's worker processes as started, by pid: the executor forgets a worker once its
        # manager thread has seen it die, and its exit code says whether a call ended it.
        self._workers: dict = {}

    MAX_RESTARTS_PER_SCORE = 16

    def _pool(self) -> ProcessPoolExecutor:
        if self._executor is None:
            # spawn, not fork: the driver holds Ray's and uvicorn's threads, which a fork would copy
            context = multiprocessing.get_context("spawn")
            self._progress = context.RawArray("q", 2 * self.num_workers)
            working_dir = working_directory()  # before spawning: spawn records the parent's os.getcwd() too
            self._executor = ProcessPoolExecutor(
                self.num_workers, mp_context=context,
                initializer=_load_in_worker, initargs=(self.function_path, working_dir, self._progress),
            )
        return self._executor

    def start(self) -> None:
        """Launch the workers now; they import the reward function while the caller goes on (the
        run starts its engines meanwhile), instead of during the first step."""
        pool = self._pool()
        with children_shielded_from_stop_signals():  # the pool starts its workers at submit, as it needs them
            for _ in range(self.num_workers):
                pool.submit(_ready)

    def score(self, calls: list[RewardCall]) -> list[RewardOutcome]:
        """One outcome per call, in order."""
        if not calls:
            return []
        outcomes: list[RewardOutcome | None] = [None] * len(calls)
        with self._lock:
            todo, restarts = list(range(len(calls))), 0
            while todo:
                fresh = self._executor is None
                left, suspects, replaced = self._score_round(calls, todo, outcomes)
                for index in suspects:  # alone, so that its worker's death can only be its doing
                    again, _, replaced_alone = self._score_round(calls, [index], outcomes, alone=True)
                    left, replaced = left + again, replaced + replaced_alone
                if fresh and not suspects and sorted(left) == todo:
                    raise RunFailed(
                        f"the reward workers exit before scoring any call: loading reward.function "
                        f"{self.function_path!r} in a worker process fails, hangs or ends it (the worker's own "
                        "error, if any, is printed above)")
                todo, restarts = sorted(left), restarts + replaced
                if todo and restarts > self.MAX_RESTARTS_PER_SCORE:
                    # Calls that kill their worker one after another: restarting for each would take
                    # minutes; the step's error count stops the run (reward.max_error_fraction).
                    for index in todo:
                        outcomes[index] = RewardOutcome(error=f"not scored: the reward workers were restarted "
                                                              f"{restarts} times in this step")
                    todo = []
        return outcomes

    def _score_round(self, calls: list[RewardCall], todo: list[int], outcomes: list, alone: bool = False,
                     ) -> tuple[list[int], list[int], int]:
        """Score calls[todo] into `outcomes`, in at most `num_workers` chunks side by side. Returns the
        calls to score again (their worker died, by another call or between calls), the suspects
        (calls that were running when a worker died, to be tried alone) and how many times the pool
        was replaced. `alone`: one call, whose worker's death is its doing."""
        size = -(-len(todo) // self.num_workers)
        chunks = [todo[i:i + size] for i in range(0, len(todo), size)]
        try:
            with children_shielded_from_stop_signals():  # a replaced pool starts its workers here
                self._pool()
                self._progress[:] = [0] * len(self._progress)
                futures = [self._executor.submit(_score_in_worker, [calls[i] for i in chunk], self.timeout_s, slot)
                           for slot, chunk in enumerate(chunks)]
                self._workers.update(getattr(self._executor, "_processes", None) or {})
        except BrokenProcessPool:  # its workers died while idle (e.g. the OOM killer)
            self._replace_pool()
            return todo, [], 1
        failed, stuck = [], False  # failed: (chunk, its worker's pid, calls started, what stopped it)
        for slot, (chunk, future) in enumerate(zip(chunks, futures, strict=True)):
            # Chunks run side by side; one whose calls cannot all finish within their limits is stuck.
            deadline = self.timeout_s * len(chunk) + 30.0
            try:
                outcomes_of_chunk = future.result(timeout=None if stuck else deadline)
            except FutureTimeout:
                stuck = True
                failed.append((chunk, *self._progress[2 * slot:2 * slot + 2], "stuck"))
                self._replace_pool()  # the other chunks' workers go too; their calls are scored again
                continue
            except (BrokenProcessPool, CancelledError):  # cancelled: the pool was replaced after a stuck chunk
                failed.append((chunk, *self._progress[2 * slot:2 * slot + 2], "died"))
                continue
            for index, outcome in zip(chunk, outcomes_of_chunk, strict=True):
                outcomes[index] = outcome
        exit_codes = self._replace_pool() if failed else {}
        # A worker that ended on its own, not by the pool's (or our) SIGTERM/SIGKILL after another did.
        ended_itself = {pid for pid, code in exit_codes.items()
                        if code is not None and code not in (-signal.SIGTERM, -signal.SIGKILL)}
        again, suspects = [], []
        for chunk, pid, started, why in failed:
            running = chunk[started - 1] if started else None
            again += [index for index in chunk if index != running]
            if running is None:
                continue
            if why == "stuck":
                outcomes[running] = RewardOutcome(error="the reward worker did not return (stuck outside Python?); "
                                                        "it was stopped")
            elif alone or (pid in ended_itself and len(ended_itself) == 1):
                outcomes[running] = RewardOutcome(error=self._killed_by(exit_codes.get(pid)))
            else:
                suspects.append(running)
        return again, suspects, int(bool(failed))

    def _killed_by(self, exit_code: int | None) -> str:
        """The error of a call that ended its worker process; said once on the console too."""
        how = _describe_exit(exit_code)
        if not self._told_of_a_killing_call:
            self._told_of_a_killing_call = True
            logger.warning("a reward call ended its reward worker process (%s); the call counts as a reward error "
                           "of its sample and the reward workers were restarted (said once; later ones are counted "
                           "in reward_errors)", how)
        return f"the reward function ended its worker process ({how}) on this response; the workers were restarted"

    def _replace_pool(self) -> dict[int, int | None]:
        """Stop the workers (a stuck call ignores anything gentler than SIGKILL); their exit codes by pid."""
        if self._executor is None:
            return {}
        processes = self._known_workers()
        _kill_and_join(processes)
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._executor, self._workers = None, {}
        return {process.pid: _exit_code(process) for process in processes}

    def close(self) -> None:
        """Let idle workers exit on the executor's request, then kill any left. Not the executor's
        shutdown(wait=True) alone: once a worker has died (the OOM killer, a kill -9 while idle), the
        executor SIGTERMs the others and waits for them to exit (CPython 3.11's
        concurrent/futures/process.py, terminate_broken -> join_executor_internals), and these
        workers block SIGTERM (children_shielded_from_stop_signals): it waited forever, and the
        driver with it, at the end of the run."""
        if self._executor is None:
            return
        processes = self._known_workers()  # before shutdown, which forgets them
        broken = bool(getattr(self._executor, "_broken", False))  # then no exit request reaches them
        self._executor.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + (0.0 if broken else CLOSE_GRACE_S)
        for process in processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        _kill_and_join(processes)
        self._executor, self._workers = None, {}

    def _known_workers(self) -> list:
        """The workers as started (the executor forgets one once its manager thread has seen it
        die) and as the executor holds them now."""
        return list({**self._workers, **(getattr(self._executor, "_processes", None) or {})}.values())


def _exit_code(process, wait_s: float = 1.0) -> int | None:
    """A joined worker's exit code. The executor's manager thread polls its workers too (is_alive
    when the pool breaks): when its waitpid reaps the worker first, ours gets ECHILD and Python's
    Popen.poll answers None until that thread has stored the code, a moment later. Waited for
    here, since a None reads as "an unknown exit" (CI saw one on a loaded machine)."""
    deadline = time.monotonic() + wait_s
    while process.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.005)
    return process.exitcode


def _kill_and_join(processes: list) -> None:
    """SIGKILL each worker still running (a no-op for one already reaped) and wait for them all."""
    for process in processes:
        process.kill()
    for process in processes:
        process.join(timeout=10)


def _describe_exit(exit_code: int | None) -> str:
    if exit_code is None:
        return "an unknown exit"
    if exit_code >= 0:
        return f"exit code {exit_code}"
    try:
        return f"signal {signal.Signals(-exit_code).name}"
    except ValueError:
        return f"signal {-exit_code}"


def make_reward_scorer(config):
    """The run's scorer from its `reward` section: the reward service at reward.url, or
    reward.function in worker processes."""
    if config.url is not None:
        # Imported here, not at the top: the spawned reward workers import this module and need no HTTP client.
        from rlsys.rewards.remote import RemoteReward

        return RemoteReward(config.url, config.batch_size, config.timeout_s, config.max_retries,
                            config.retry_backoff_s, config.max_concurrency)
    return RewardPool(config.function, config.num_workers, config.timeout_s)


def make_run_scorer(config, environment=None, has_gpu: bool = False):
    """The run's scorer: its task environment's (a verifiers rubric), a judge on engines of its own
    (reward.judge, its logs in RUN_DIR/logs/judge), or the `reward` section's (`make_reward_scorer`)."""
    if environment is not None:
        return environment.scorer(config.reward.timeout_s)
    if config.reward.judge is not None:
        from pathlib import Path

        from rlsys.rewards.judge import JudgeScorer

        log_dir = Path(config.run_dir or ".") / "logs" / "judge"
        return JudgeScorer(config.reward.judge, log_dir, config.seed, has_gpu, dict(config.placement.env))
    return make_reward_scorer(config.reward)
