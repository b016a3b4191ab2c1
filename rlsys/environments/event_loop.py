"""One asyncio loop in a thread of its own, for async code that must be called from synchronous
code while another loop may be running in the calling thread (a rubric's async reward functions,
called from the driver's scoring step)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any


class LoopThread:
    """`run(coroutine, timeout_s)` runs it on this object's loop and waits for its result."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coroutine: Coroutine[Any, Any, Any], timeout_s: float | None = None) -> Any:
        """Its result; TimeoutError after `timeout_s` (the coroutine is cancelled)."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=5)
