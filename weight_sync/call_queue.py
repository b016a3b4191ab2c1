"""A transport's engine calls, run one at a time in order on one thread of their own.

The weight sync queues a bucket's hand-over and goes on gathering the next bucket while the
engine loads it (weight_sync/sync.py); the calls themselves stay strictly ordered, as SGLang's
weight-update session needs (begin, the buckets, end). After a call fails, the bucket calls
queued behind it fail at once with the same error instead of each waiting on an engine that has
already failed; calls queued with `always=True` (closing the session) still run.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


class EngineCallQueue:
    def __init__(self, name: str, on_thread_start: Callable[[], None] | None = None):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name,
                                            initializer=on_thread_start)
        self._lock = threading.Lock()
        self._failure: BaseException | None = None

    def reset(self) -> None:
        """A new sync: earlier failures no longer skip calls."""
        self.take_failure()

    def take_failure(self) -> BaseException | None:
        """The first failure since the last reset, forgotten here (as by `reset`): an error keeps
        the frames of its traceback alive, and with them whatever the failed call referenced."""
        with self._lock:
            failure, self._failure = self._failure, None
        return failure

    def submit(self, call: Callable[[], None], always: bool = False) -> Future:
        def run():
            with self._lock:
                earlier = self._failure
            if earlier is not None and not always:
                raise earlier
            try:
                call()
            except BaseException as error:
                with self._lock:
                    self._failure = self._failure or error
                raise

        return self._executor.submit(run)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
