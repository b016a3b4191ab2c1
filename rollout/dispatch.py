"""Dealing requests to engines: least outstanding work first, and a gate for weight updates.

Requests run as coroutines on one event loop in a background thread (`LoopThread`); Ray's
ObjectRefs are awaited there, so many requests (or multi-turn trajectories) are in flight at
once while the caller's thread blocks on a future, or goes on with other work (the
one-step-off-policy pipeline trains while the next batch generates).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager

from rlsys.records import SamplingParams


class LoopThread:
    """An asyncio loop in a daemon thread; `submit` is callable from any thread."""

    def __init__(self, name: str = "rollout-loop"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coroutine: Coroutine) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


class Dispatcher:
    """Which engine takes the next request: the one with the least work outstanding (in samples),
    among those under `limit` (None: no limit). A slow engine keeps its requests longer and so
    gets fewer of them. While the gate is closed (a weight update), no request starts; closing
    it waits for the requests in flight to finish. Used only from the loop's thread."""

    def __init__(self, num_engines: int):
        self.outstanding = [0] * num_engines
        self.served = [0] * num_engines  # samples each engine has taken, over the run
        self._changed = asyncio.Condition()
        self._open = True

    def _pick(self, weight: int, limit: int | None) -> int | None:
        if not self._open:
            return None
        index = min(range(len(self.outstanding)), key=lambda i: (self.outstanding[i], i))
        load = self.outstanding[index]
        return index if limit is None or load == 0 or load + weight <= limit else None

    @asynccontextmanager
    async def engine(self, weight: int = 1, limit: int | None = None):
        """Hold the least-loaded engine's index for one request of `weight` samples."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._pick(weight, limit) is not None)
            index = self._pick(weight, limit)
            self.outstanding[index] += weight
            self.served[index] += weight
        try:
            yield index
        finally:
            async with self._changed:
                self.outstanding[index] -= weight
                self._changed.notify_all()

    async def close_gate(self) -> None:
        """No new request starts; returns once none is in flight."""
        async with self._changed:
            self._open = False
            await self._changed.wait_for(lambda: not any(self.outstanding))

    async def open_gate(self) -> None:
        async with self._changed:
            self._open = True
            self._changed.notify_all()


class RequestBatcher:
    """Engine calls made within `window_s` of each other, to the same engine with the same
    sampling parameters, travel as one request (one Ray call, one HTTP request, one batch in the
    server) instead of one each: many concurrent trajectories cost a few requests per turn. Each
    call keeps its own sampling seed in the batch. Used only from the loop's thread."""

    def __init__(self, send: Callable[[int, list[list[int]], SamplingParams, list[int | None]], Awaitable[list]],
                 window_s: float = 0.002):
        self.send = send
        self.window_s = window_s
        self.requests_sent = 0
        self._queues: dict[tuple[int, str], list[tuple[list[int], int | None, asyncio.Future]]] = {}

    async def generate(self, index: int, input_ids: list[int], params: SamplingParams, seed: int | None = None):
        key = (index, json.dumps(params.as_sglang(), sort_keys=True))
        queue = self._queues.setdefault(key, [])
        future = asyncio.get_running_loop().create_future()
        queue.append((input_ids, seed, future))
        if len(queue) == 1:
            asyncio.ensure_future(self._flush(key, params))
        return await future

    async def _flush(self, key: tuple[int, str], params: SamplingParams) -> None:
        await asyncio.sleep(self.window_s)
        batch = self._queues.pop(key)
        self.requests_sent += 1
        try:
            answers = await self.send(key[0], [ids for ids, _, _ in batch], params, [seed for _, seed, _ in batch])
        except BaseException as error:  # noqa: BLE001 - every caller gets the request's failure
            for _, _, future in batch:
                if not future.done():
                    future.set_exception(error)
            return
        for (_, _, future), answer in zip(batch, answers, strict=True):
            if not future.done():
                future.set_result(answer)
