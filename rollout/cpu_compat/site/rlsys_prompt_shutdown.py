"""SGLang's server notices a SIGTERM within 0.1 s instead of within 5 s (CPU servers only).

On SIGTERM, SGLang's signal handler only sets `TokenizerManager.gracefully_exit`; its
`sigterm_watchdog` task checks that flag every 5 seconds before it drains requests and stops the
scheduler. The launcher stops every engine with SIGTERM at the end of a run (and on a restart),
so each stop waited 0-5 s for nothing: a standalone server took 6.4 s from SIGTERM to exit here.
This waits for the flag in 0.1 s steps, then hands over to SGLang's own watchdog, whose wait then
ends at once: the drain and shutdown are SGLang's, unchanged.

Installed by `sitecustomize` (`watch_sigterm_often`) when SGLang imports its tokenizer manager.
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

