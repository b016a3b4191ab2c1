"""Connections to the status server that cannot lock live clients out.

uvicorn's `limit_concurrency` counts open connections, idle ones included, and uvicorn times a
connection out only after a response (keep-alive): a connection that never sends a request, or
stops halfway through its headers, stays open for good. 300 of them used to make `/healthz` and
even `POST /api/v1/stop` answer 503 for as long as they stayed. Here, per connection (uvicorn's h11
protocol, subclassed as its `http` setting allows):
- a connection must have a whole request in within `request_timeout_s` of opening or of its last
  response, else it is closed (idle and half-sent alike; a request being answered is never cut);
- at most `max_per_client` are open from one client address: a new one closes that client's
  longest-idle one, so one client cannot fill the server and push others' connections out;
- at most `max_connections` are open: a new one closes the longest-idle one instead of being
  refused, so an operator who connects is answered at once however many idle ones are held.
One in-flight request per connection (h11 has no multiplexing) bounds concurrent requests too.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_CONNECTIONS = 256  # open at once (memory); a new one beyond this closes the longest-idle one
MAX_PER_CLIENT = 64  # open at once from one address (a browser keeps about 6); beyond, its own longest-idle goes
REQUEST_TIMEOUT_S = 10.0  # to send a whole request's headers after connecting or after the last answer


class GuardedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with bounds on connections: `guarded_protocol` sets them."""

    max_connections: int = MAX_CONNECTIONS
    request_timeout_s: float = REQUEST_TIMEOUT_S
    max_per_client: int = MAX_PER_CLIENT
    _deadline: asyncio.TimerHandle | None = None
    _idle_since: float = 0.0

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._became_idle()
        host = self.client[0] if self.client else None
        if host is not None:
            same_client = [c for c in self._open() if c.client and c.client[0] == host]
            idle = [c for c in same_client if c is not self and c._idle()]
            if len(same_client) > self.max_per_client and idle:  # (all busy: the global bound below decides)
                min(idle, key=lambda c: c._idle_since)._close()
        if len(self._open()) > self.max_connections:
            idle = [c for c in self._open() if c is not self and c._idle()]
            if idle:
                min(idle, key=lambda c: c._idle_since)._close()
            else:  # every other connection is being answered: this one waits its turn nowhere
                self._close()

    def connection_lost(self, exc) -> None:
        self._cancel_deadline()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._became_idle()

    def _open(self) -> list:
        """The connections not already closing (one closed here leaves the set a moment later)."""
        return [c for c in self.connections if not c.transport.is_closing()]

    def _idle(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _became_idle(self) -> None:
        self._cancel_deadline()
        self._idle_since = self.loop.time()
        self._deadline = self.loop.call_later(self.request_timeout_s, self._deadline_passed)

    def _deadline_passed(self) -> None:
        self._deadline = None
        if self._idle():  # no request came in whole since: idle or half-sent
            self._close()

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _close(self) -> None:
        self._cancel_deadline()
        if not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(max_connections: int = MAX_CONNECTIONS, request_timeout_s: float = REQUEST_TIMEOUT_S,
                     max_per_client: int = MAX_PER_CLIENT) -> type[GuardedH11Protocol]:
    """The protocol class for uvicorn.Config(http=...), with these bounds."""
    bounds = {"max_connections": max_connections, "request_timeout_s": request_timeout_s,
              "max_per_client": max_per_client}
    return type("GuardedH11Protocol", (GuardedH11Protocol,), bounds)
