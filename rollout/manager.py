"""`RolloutManager`: the set of engines, spreading generation requests over them."""

from __future__ import annotations

import ray

from rlsys.rollout.client import EngineAddress
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


class RolloutManager:
    def __init__(self, spec: ServerSpec, num_engines: int, log_dir: str, actor_options: list[dict]):
        remote_cls = ray.remote(RolloutEngine)
        self.engines = [
            remote_cls.options(**actor_options[index]).remote(spec, f"engine-{index}", f"{log_dir}/engine_{index}.log")
            for index in range(num_engines)
        ]
        # Servers start in the background; call wait_ready() before using them.
        self._starting = [e.start.remote(spec.engine.startup_timeout_s) for e in self.engines]
        self.addresses: list[EngineAddress] = []

    def wait_ready(self) -> list[EngineAddress]:
        if not self.addresses:
            self.addresses = ray.get(self._starting)
        return self.addresses

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, n: int) -> list[Generation]:
        """n samples per prompt, grouped prompt by prompt in the caller's order."""
        blocks = deal_prompts(prompts, len(self.engines))
        answers = ray.get([e.generate.remote(b, sampling, n) for e, b in zip(self.engines, blocks, strict=True)])
        return collect_in_prompt_order(answers, len(prompts), n)

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

    def weight_versions(self) -> list[int]:
        return ray.get([e.weight_version.remote() for e in self.engines])

    def shutdown(self) -> None:
        for engine in self.engines:
            try:
                ray.get(engine.shutdown.remote(), timeout=60)
            except Exception:  # noqa: BLE001 - kill the actor even if its server is already gone
                pass
            ray.kill(engine)
        self.engines = []
