"""The CPU engine's server acts on a SIGTERM within 0.1 s instead of SGLang's 5 s check, its idle
scheduler leaves on the shutdown request instead of after one more 1 s idle sleep
(rollout/sglang/cpu_compat/site/rlsys_prompt_shutdown.py), and the shutdown itself is SGLang's."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

from rlsys.rollout.sglang.server import CPU_COMPAT_SITE

sys.path.insert(0, str(CPU_COMPAT_SITE))
import rlsys_prompt_shutdown  # noqa: E402 - lives in the server's compatibility layer

sys.path.remove(str(CPU_COMPAT_SITE))


class _Manager:
    gracefully_exit = False


def test_the_watchdog_polls_in_short_steps_then_runs_sglangs_own_once(monkeypatch):
    manager, calls, sleeps = _Manager(), [], []

    async def sglangs_watchdog(self):
        calls.append(self.gracefully_exit)  # its own 5 s wait ends at once: the flag is set

    async def sleep(seconds):
        sleeps.append(seconds)
        if len(sleeps) == 3:
            manager.gracefully_exit = True  # SIGTERM arrives during the third wait

    monkeypatch.setattr(rlsys_prompt_shutdown.asyncio, "sleep", sleep)
    asyncio.run(rlsys_prompt_shutdown.watch_sigterm_often(sglangs_watchdog)(manager))
    assert sleeps == [rlsys_prompt_shutdown.POLL_S] * 3
    assert calls == [True]


class _Scheduler:
    gracefully_exit = False


def test_an_idle_scheduler_sleeps_until_it_is_asked_to_exit_then_leaves_at_once():
    scheduler, slept = _Scheduler(), []
    maybe_sleep = rlsys_prompt_shutdown.skip_idle_sleep_when_exiting(lambda self: slept.append(self))
    maybe_sleep(scheduler)
    assert slept == [scheduler]  # idle and running: SGLang's own sleep
    scheduler.gracefully_exit = True  # its ShutdownReq arrived
    maybe_sleep(scheduler)
    assert slept == [scheduler]


CHECK = r"""
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.tokenizer_manager import TokenizerManager
assert hasattr(TokenizerManager.sigterm_watchdog, "rlsys_original"), "the prompt shutdown was not installed"
assert hasattr(Scheduler.maybe_sleep_on_idle, "rlsys_original"), "the scheduler's prompt exit was not installed"
print("ok")
"""


def test_the_servers_compatibility_layer_installs_it():
    env = {**os.environ, "PYTHONPATH": str(CPU_COMPAT_SITE), "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("ok")
