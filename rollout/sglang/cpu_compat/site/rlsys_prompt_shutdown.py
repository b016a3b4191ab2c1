"""SGLang's server notices a SIGTERM within 0.1 s instead of within 5 s (CPU servers only).

On SIGTERM, SGLang's signal handler only sets `TokenizerManager.gracefully_exit`; its
`sigterm_watchdog` task checks that flag every 5 seconds before it drains requests and stops the
scheduler. The launcher stops every engine with SIGTERM at the end of a run (and on a restart),
so each stop waited 0-5 s for nothing: a standalone server took 6.4 s from SIGTERM to exit here.
This waits for the flag in 0.1 s steps, then hands over to SGLang's own watchdog, whose wait then
ends at once: the drain and shutdown are SGLang's, unchanged.

The scheduler then gets SGLang's ShutdownReq, which only sets its `gracefully_exit` flag; an idle
scheduler started with --sleep-on-idle (every CPU server) went back to its idle sleep, a 1 s poll,
before its loop looked at the flag again: a server that had served a request took 1.6 s from
SIGTERM to exit here, against 0.2 s for one that had not. `skip_idle_sleep_when_exiting` makes it
leave at once.

Installed by `sitecustomize` (`watch_sigterm_often`, `skip_idle_sleep_when_exiting`) when SGLang
imports its tokenizer manager and its scheduler.
"""

from __future__ import annotations

import asyncio

POLL_S = 0.1


def watch_sigterm_often(original):
    async def sigterm_watchdog(self):
        while not self.gracefully_exit:
            await asyncio.sleep(POLL_S)
        await original(self)

    return sigterm_watchdog


def skip_idle_sleep_when_exiting(original):
    def maybe_sleep_on_idle(self):
        if not self.gracefully_exit:
            original(self)

    return maybe_sleep_on_idle
