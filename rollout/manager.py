"""`RolloutManager`: the set of engines, spreading generation requests over them."""

from __future__ import annotations

import ray

from rollout.engine import Generation, RolloutEngine, SamplingParams
from rollout.server import ServerSpec


class RolloutManager:
    def __init__(self, spec: ServerSpec, num_engines: int, log_dir: str, actor_options: list[dict],
                 startup_timeout_s: float, request_timeout_s: float, force_cpu: bool = False):
        remote_cls = ray.remote(RolloutEngine)
        self.engines = [
            remote_cls.options(**actor_options[index]).remote(
                spec, f"{log_dir}/engine_{index}.log", request_timeout_s, force_cpu
            )
            for index in range(num_engines)
        ]
        self.tp_size = spec.tp_size
        # Servers start in the background; call wait_ready() before using them.
        self._starting = [e.start.remote(startup_timeout_s) for e in self.engines]
        self.urls: list[str] = []

    def wait_ready(self) -> list[str]:
        if not self.urls:
            self.urls = ray.get(self._starting)
        return self.urls

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, n: int) -> list[Generation]:
        """n samples per prompt, grouped prompt by prompt; prompts are dealt to engines in blocks."""
        blocks = [prompts[i::len(self.engines)] for i in range(len(self.engines))]
        answers = ray.get([e.generate.remote(b, sampling, n) for e, b in zip(self.engines, blocks, strict=False)])
        # Reassemble in the caller's prompt order: prompt p went to engine p % E at slot p // E.
        ordered: list[Generation] = []
        for p in range(len(prompts)):
            engine, slot = p % len(self.engines), p // len(self.engines)
            ordered.extend(answers[engine][slot * n:(slot + 1) * n])
        return ordered

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
