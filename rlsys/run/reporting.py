"""Feed a `RunStatus` from the running components: actor health, and the server's life."""

from __future__ import annotations

import logging
import os
import re
import sys
import time
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from rlsys.config import RunConfig
from rlsys.observability.status.state import ActorHealth, RunStatus
from rlsys.run.assets import RunAssets

logger = logging.getLogger(__name__)


def collect_actor_health(trainer, rollout) -> list[ActorHealth]:
    now = time.time()
    actors = [
        ActorHealth(name=f"trainer-rank-{r['rank']}", kind="trainer", alive=r["alive"],
                    last_heartbeat=now if r["alive"] else None, memory_bytes=r["memory_bytes"],
                    detail=r.get("error", ""))
        for r in trainer.health()
    ]
    actors += [
        ActorHealth(name=f"engine-{e['index']}", kind="engine", alive=e["alive"],
                    last_heartbeat=now if e["alive"] else None, memory_bytes=e["memory_bytes"],
                    detail=e.get("error", e.get("url", "")))
        for e in rollout.fleet.health()
    ]
    return actors


class HealthMonitor:
    """Refreshes the status's actor table at most every `interval_s` (a health round trip costs
    the loop time), and always at the last step."""

    def __init__(self, parts, interval_s: float = 5.0):
        self.parts, self.interval_s = parts, interval_s
        self._last = float("-inf")

    def due(self, last_step: bool = False) -> bool:
        return last_step or time.monotonic() - self._last >= self.interval_s

    def refresh(self, status: RunStatus) -> None:
        status.set_actors(collect_actor_health(self.parts.trainer, self.parts.rollout))
        self._last = time.monotonic()


def shows_progress_bar(progress_bar: bool, stream=None) -> bool:
    """logging.progress_bar, where a terminal shows it: a `ray job submit` or CI log (stderr not a
    terminal) would only collect the bar's redraws, so such a run prints progress lines instead."""
    stream = sys.stderr if stream is None else stream
    return progress_bar and hasattr(stream, "isatty") and stream.isatty()


class ProgressLines:
    """What a run says as it goes where no progress bar shows it (logging.progress_bar off, or stderr
    not a terminal, as in a `ray job submit` log: `shows_progress_bar`): a line for every eval, and a
    step summary at most every `interval_s` (the first and last steps always). With the bar shown
    they are debug lines (`-v`)."""

    EVAL_KEY = re.compile(r"^eval_(?:.+_)?(?:reward_mean|pass_at_\d+)$")

    def __init__(self, total_steps: int, progress_bar: bool, interval_s: float, clock=time.monotonic):
        self.total_steps, self.interval_s, self.clock = total_steps, interval_s, clock
        self.level = logging.DEBUG if progress_bar else logging.INFO
        self._last = float("-inf")

    def step(self, row: dict, last_step: bool) -> None:
        where = f"step {row['step'] + 1}/{self.total_steps}"
        evals = {key: value for key, value in row.items() if self.EVAL_KEY.match(key) and isinstance(value, float)}
        if evals:
            logger.log(self.level, "%s: %s", where, ", ".join(f"{key} {value:.3f}" for key, value in evals.items()))
        now = self.clock()
        if row["step"] == 0 or last_step or now - self._last >= self.interval_s:
            self._last = now
            shown = [f"{name} {row[key]:.3g}" for key, name in (("reward_mean", "reward"), ("loss", "loss"),
                                                                ("kl", "kl"), ("response_len_mean", "response_len"))
                     if isinstance(row.get(key), float)]
            logger.log(self.level, "%s: %s; %.2f s", where, ", ".join(shown) or "no sample scored",
                       row.get("time_step_s", 0.0))


def new_status(config: RunConfig, run_dir: Path, assets: RunAssets, resuming: bool = False,
               stacks: Callable[[], dict | None] | None = None) -> RunStatus:
    """A fresh status; a resumed run's carries the seconds its earlier processes ran and when the
    first of them started (read from the status.json they left, before this one overwrites it).
    `stacks`: what answers a request for every process's stacks (RunEvents.stacks_on_request)."""
    dataset = {"train_prompts": len(assets.train), "eval_prompts": len(assets.eval),
               "skipped_rows": assets.skipped_rows, "too_long_prompts": assets.too_long_prompts}
    return RunStatus(run_id=f"{run_dir.name}-{uuid.uuid4().hex[:6]}", total_steps=config.trainer.total_steps,
                     run_dir=str(run_dir), dataset=dataset,
                     earlier_s=RunStatus.seconds_run_so_far(run_dir) if resuming else 0.0,
                     first_started_at=RunStatus.first_start(run_dir) if resuming else None, stacks_provider=stacks)


@contextmanager
def status_server(config: RunConfig, status: RunStatus):
    """Serve `status` for the duration of the block (nothing when status.enabled is false)."""
    if not config.status.enabled:
        yield None
        return
    from rlsys.observability.status.server import StatusServer

    token = config.status.token or os.environ.get("RLSYS_STATUS_TOKEN") or None
    server = StatusServer(status, config.status.host, config.status.port, token,
                          config.status.allow_unauthenticated_read)
    url = server.start()
    status.status_url = url
    logger.info("status and dashboard at %s/ (API: %s/api/v1/status)", url, url)
    try:
        yield url
    finally:
        server.stop()
