"""`RolloutManager`: the set of engines, spreading generation requests over them."""

from __future__ import annotations

from collections.abc import Callable

import ray
from ray.exceptions import RayActorError, RayTaskError

from rlsys.rollout.client import EngineAddress, EngineDied
from rlsys.rollout.engine import Generation, RolloutEngine, SamplingParams
from rlsys.rollout.server import ServerSpec


def deal_prompts(prompts: list, num_engines: int) -> list[list]:
    """Prompt p goes to engine p % E, at slot p // E of that engine's block."""
    return [prompts[i::num_engines] for i in range(num_engines)]


def collect_in_prompt_order(answers: list[list], num_prompts: int, n: int) -> list:
    """Undo `deal_prompts`: engine blocks of n answers per prompt back into the caller's order."""
    ordered = []
    for p in range(num_prompts):
        engine, slot = p % len(answers), p // len(answers)
        ordered.extend(answers[engine][slot * n:(slot + 1) * n])
    return ordered


class EngineRestartLimit(RuntimeError):
    """An engine died after rollout.engine.max_restarts restarts were used up."""


def is_engine_death(error: BaseException) -> bool:
    """A dead engine actor, or an engine whose SGLang server has exited."""
    if isinstance(error, RayActorError):
        return True
    cause = getattr(error, "cause", None) if isinstance(error, RayTaskError) else error
    return isinstance(cause, EngineDied)


class RolloutManager:
    """The engines behind one call. A dead engine is restarted in its placement slot (at most
    `max_restarts` times over the run); `on_restart(index)`, set by the coordinator, brings it to
    the current weights and version before its unfinished requests are issued again."""

    def __init__(self, spec: ServerSpec, num_engines: int, log_dir: str, actor_options: list[dict]):
        self.spec = spec
        self.log_dir = log_dir
        self.actor_options = actor_options
        self.max_restarts = spec.engine.max_restarts
        self.restarts = 0
        self.on_restart: Callable[[int], None] | None = None
        self.engines = [self._launch(index) for index in range(num_engines)]
        # Servers start in the background; call wait_ready() before using them.
        self._starting = [e.start.remote(spec.engine.startup_timeout_s) for e in self.engines]
        self.addresses: list[EngineAddress] = []

    def _launch(self, index: int):
        return ray.remote(RolloutEngine).options(**self.actor_options[index]).remote(
            self.spec, f"engine-{index}", f"{self.log_dir}/engine_{index}.log")

    def wait_ready(self) -> list[EngineAddress]:
        if not self.addresses:
            self.addresses = ray.get(self._starting)
        return self.addresses

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, n: int) -> list[Generation]:
        """n samples per prompt, grouped prompt by prompt in the caller's order. The block of an
        engine that dies is issued again once the engine has been restarted."""
        blocks = deal_prompts(prompts, len(self.engines))
        answers: dict[int, list[Generation]] = {}
        pending = dict(enumerate(blocks))
        while pending:
            calls = {i: self.engines[i].generate.remote(block, sampling, n) for i, block in pending.items()}
            failed = {}
            for index, call in calls.items():
                try:
                    answers[index] = ray.get(call)
                except (RayActorError, RayTaskError) as error:
                    failed[index] = error
            # Only once every engine is idle: a restart re-syncs weights into all of them.
            for index, error in failed.items():
                self.recover(index, error)
            pending = {index: blocks[index] for index in failed}
        return collect_in_prompt_order([answers[i] for i in range(len(blocks))], len(prompts), n)

    def recover(self, index: int, error: BaseException) -> None:
        """Restart engine `index` after `error` if that is what it was; otherwise re-raise."""
        if not is_engine_death(error):
            raise error
        self.restart(index, f"{getattr(error, 'cause', None) or error}")

    def restart(self, index: int, reason: str) -> None:
        """A fresh engine in the dead one's slot, then `on_restart(index)`."""
        if self.restarts >= self.max_restarts:
            raise EngineRestartLimit(
                f"engine-{index} died and its {self.max_restarts} restarts (rollout.engine.max_restarts) are used "
                f"up: {reason}"
            )
        print(f"rlsys: engine-{index} died; restarting it ({self.restarts + 1} of {self.max_restarts}): "
              f"{reason.splitlines()[0] if reason else ''}", flush=True)
        self.restarts += 1
        self._stop(self.engines[index])
        self.engines[index] = self._launch(index)
        self.addresses[index] = ray.get(self.engines[index].start.remote(self.spec.engine.startup_timeout_s))
        if self.on_restart is not None:
            self.on_restart(index)

    def dead_engines(self) -> list[int]:
        """Engines whose actor or server is gone (one quick round of health checks)."""
        return [report["index"] for report in self.health() if not report["alive"]]

    def score(self, sequences: list[list[int]], engine_index: int = 0) -> list[list[float]]:
        return ray.get(self.engines[engine_index].score.remote(sequences))

    def health(self, timeout_s: float = 10.0) -> list[dict]:
        """Per engine: alive, memory_bytes, url; a dead or unresponsive actor reads as not alive."""
        reports = []
        for index, engine in enumerate(self.engines):
            try:
                report = ray.get(engine.health.remote(), timeout=timeout_s)
            except Exception as error:  # noqa: BLE001 - the actor itself may be gone
                report = {"alive": False, "memory_bytes": None, "url": "", "error": str(error)[:200]}
            reports.append({"index": index, **report})
        return reports

    def memory(self) -> list[dict]:
        """Per engine: device bytes (None on CPU), host RSS of its processes, released regions."""
        return self._on_every_engine("memory")

    def release_memory(self, tags: list[str]) -> list[dict]:
        """Every engine gives the tagged regions back to the device; their memory reports."""
        return self._on_every_engine("release_memory", list(tags))

    def resume_memory(self, tags: list[str]) -> list[dict]:
        """Every engine takes back those of the tagged regions it had released."""
        return self._on_every_engine("resume_memory", list(tags))

    def _on_every_engine(self, method: str, *args) -> list:
        """`method` on every engine; an engine found dead is restarted (brought up to date by
        `on_restart`) and asked again."""
        calls = [getattr(engine, method).remote(*args) for engine in self.engines]
        answers = []
        for index, call in enumerate(calls):
            try:
                answers.append(ray.get(call))
            except (RayActorError, RayTaskError) as error:
                self.recover(index, error)
                answers.append(ray.get(getattr(self.engines[index], method).remote(*args)))
        return answers

    def weight_versions(self) -> list[int]:
        return ray.get([e.weight_version.remote() for e in self.engines])

    @staticmethod
    def _stop(engine) -> None:
        try:
            ray.get(engine.shutdown.remote(), timeout=60)
        except Exception:  # noqa: BLE001 - kill the actor even if its server is already gone
            pass
        ray.kill(engine)

    def shutdown(self) -> None:
        for engine in self.engines:
            self._stop(engine)
        self.engines = []
