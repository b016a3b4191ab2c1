"""task.openenv: an OpenEnv environment server as the run's turns and reward (openenv-core 0.3.0's
GenericEnvClient: one WebSocket session per episode, actions and observations as plain dicts).

Each sample is an episode: `reset()`, then one policy turn per step (an engine call continuing the
sample's tokens), its text sent as the action `{task.openenv.action_field: text}`, until the
environment says done or task.openenv.max_turns steps. After a step that does not end the episode,
the observation's `observation_field` text is appended as injected tokens (masked out of the loss).
The sample's reward is the sum of its steps' rewards; the episode (reset observation, each step's
action, observation, reward and done) rides in the generation's info, so it is in the reward's
metadata and, with logging.save_rollouts, in every saved rollout row. An episode whose reset or step
fails or runs past task.openenv.timeout_s is that sample's reward error.

With `command`, the server is started when the run's scorer starts (on a free port, in a process
group of its own, waited for on /health) and stopped with it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlsys.config import OpenEnvTaskConfig
from rlsys.errors import UserError
from rlsys.records import EncodedPrompt, RewardCall, RewardOutcome
from rlsys.rollout.trajectory import RolloutContext, Trajectory

logger = logging.getLogger(__name__)

EPISODE_KEY = "openenv_episode"  # a generation's info: the episode, with its reward or error


class OpenEnvError(UserError):
    """The OpenEnv server could not be started or reached."""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _jsonable(value):
    """An observation as JSON keeps it (pydantic models and other objects as their dict or text)."""
    if hasattr(value, "model_dump"):
        return value.model_dump()
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value if isinstance(value, str | int | float | bool | type(None)) else str(value)


@dataclass
class OpenEnvTask:
    config: OpenEnvTaskConfig
    url: str | None = None
    server: subprocess.Popen | None = None
    server_log: str | None = None
    sessions: dict = field(default_factory=dict, repr=False)  # event loop -> its semaphore of open episodes

    def __post_init__(self):
        self.url = self.config.url

    # ---- the server's life -----------------------------------------------------------------

    def start_server(self) -> None:
        if self.config.command is None or self.server is not None:
            return
        port = _free_port()
        command = [part.replace("{port}", str(port)).replace("{python}", sys.executable) for part in self.config.command]
        # Its output to a file (a pipe nobody reads fills up, and the server blocks writing its log).
        descriptor, self.server_log = tempfile.mkstemp(prefix="rlsys-openenv-", suffix=".log")
        with os.fdopen(descriptor, "w") as log:
            self.server = subprocess.Popen(command, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}"
        self._wait_healthy()
        logger.info("OpenEnv server %s up at %s (its output in %s)", " ".join(command), self.url, self.server_log)

    def _wait_healthy(self) -> None:
        import httpx

        deadline = time.monotonic() + self.config.start_timeout_s
        while True:
            if self.server.poll() is not None:
                output = Path(self.server_log).read_text(errors="replace")[-2000:]
                raise OpenEnvError(f"task.openenv.command exited with {self.server.returncode} before answering: "
                                   f"{output}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop_server()
                raise OpenEnvError(f"task.openenv.command did not answer {self.url}/health within "
                                   f"{self.config.start_timeout_s:g} s (task.openenv.start_timeout_s)")
            time.sleep(0.2)

    def stop_server(self) -> None:
        if self.server is None:
            return
        if self.server.poll() is None:
            os.killpg(self.server.pid, signal.SIGTERM)
            try:
                self.server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.server.pid, signal.SIGKILL)
                self.server.wait()
        self.server = None

    # ---- what the run takes ----------------------------------------------------------------

    def scorer(self, timeout_s: float) -> EpisodeRewards:
        return EpisodeRewards(self)

    def generate_function(self):
        return self.episode

    def describe(self) -> str:
        return f"the OpenEnv environment at {self.url or ' '.join(self.config.command)}"

    async def episode(self, prompt: EncodedPrompt, ctx: RolloutContext) -> Trajectory:
        """One sample: an episode on a session of its own."""
        loop = asyncio.get_running_loop()  # a semaphore belongs to the loop that runs the episodes
        sessions = self.sessions.setdefault(loop, asyncio.Semaphore(self.config.max_sessions))
        async with sessions:
            record = {"reset": None, "steps": [], "reward": 0.0, "error": None}
            try:
                await asyncio.wait_for(self._play(ctx, record), self._budget())
            except Exception as error:  # noqa: BLE001 - the environment's failure is this sample's reward error
                record["error"] = f"{type(error).__name__}: {error}"[:2000]
            ctx.trajectory.info[EPISODE_KEY] = record
            return ctx.trajectory

    def _budget(self) -> float:
        """An episode's whole time: each reset and step may take timeout_s (the engine's turns are not counted
        apart; an engine that hangs is the fleet's to find)."""
        return self.config.timeout_s * (self.config.max_turns + 1) + 600.0

    async def _play(self, ctx: RolloutContext, record: dict) -> None:
        from openenv.core import GenericEnvClient

        client = GenericEnvClient(base_url=self.url, message_timeout_s=self.config.timeout_s)
        try:
            reset = await client.reset()
            record["reset"] = _jsonable(reset.observation)
            for turn in range(self.config.max_turns):
                completion = await ctx.generate()
                text = ctx.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
                result = await client.step({self.config.action_field: text})
                reward = float(result.reward) if result.reward is not None else 0.0
                record["steps"].append({"action": {self.config.action_field: text},
                                        "observation": _jsonable(result.observation), "reward": result.reward,
                                        "done": bool(result.done)})
                record["reward"] += reward
                if result.done or turn == self.config.max_turns - 1:
                    break
                shown = (result.observation or {}).get(self.config.observation_field) \
                    if self.config.observation_field else None
                if shown is not None:
                    ctx.append(str(shown))
        finally:
            await client.disconnect()


class EpisodeRewards:
    """The run's scorer: each sample's episode reward (the sum of its steps'), or its episode's error."""

    def __init__(self, task: OpenEnvTask):
        self.task = task

    def start(self) -> None:
        self.task.start_server()

    def close(self) -> None:
        self.task.stop_server()

    def score(self, calls: list[RewardCall]) -> list[RewardOutcome]:
        outcomes = []
        for call in calls:
            episode = call.metadata.get(EPISODE_KEY)
            if episode is None:
                outcomes.append(RewardOutcome(error="the sample has no OpenEnv episode (task.openenv)"))
            elif episode["error"] is not None:
                outcomes.append(RewardOutcome(error=f"the OpenEnv episode failed: {episode['error']}"))
            else:
                outcomes.append(RewardOutcome(value=episode["reward"]))
        return outcomes
