"""`TrainerGroup`: N TrainerWorker ranks as Ray actors, driven as one trainer."""

from __future__ import annotations

from dataclasses import replace

import ray

from actors.batching import TrainSequence, split_evenly
from actors.trainer import TrainerSpec, TrainerWorker


class TrainerGroup:
    def __init__(self, spec: TrainerSpec, num_ranks: int, actor_options: list[dict] | None = None,
                 env_vars: dict[str, str] | None = None, worker_cls: type = TrainerWorker):
        self.spec = spec
        self.num_ranks = num_ranks
        options = actor_options or [{"num_cpus": 1}] * num_ranks
        runtime_env = {"env_vars": env_vars or {}}
        remote_cls = ray.remote(worker_cls)
        self.workers = [
            remote_cls.options(**options[rank], runtime_env=runtime_env).remote(
                replace(spec), rank, num_ranks
            )
            for rank in range(num_ranks)
        ]
        address, port = ray.get(self.workers[0].rendezvous_address.remote())
        ray.get([worker.setup.remote(address, port) for worker in self.workers])

    def _shares(self, sequences: list[TrainSequence]) -> list[list[TrainSequence]]:
        return split_evenly(sequences, self.num_ranks)

    def compute_log_probs(self, sequences: list[TrainSequence]) -> list[list[float]]:
        shares = self._shares(sequences)
        results = ray.get([w.compute_log_probs.remote(s) for w, s in zip(self.workers, shares, strict=False)])
        return [logprobs for share in results for logprobs in share]

    def train_step(self, sequences: list[TrainSequence]) -> dict[str, float]:
        """Split into `mini_batches_per_step` global mini-batches, then each over the ranks."""
        minis = split_evenly(sequences, self.spec.mini_batches_per_step)
        per_rank = [[split_evenly(mini, self.num_ranks)[rank] for mini in minis] for rank in range(self.num_ranks)]
        results = ray.get([w.train_step.remote(parts) for w, parts in zip(self.workers, per_rank, strict=True)])
        return results[0]  # metrics are all-reduced: every rank returns the same

    def sync_weights(self, engine_urls: list[str], engine_tp_size: int, bucket_bytes: int,
                     weight_version: int) -> list[dict]:
        """Colocated sync: rank i feeds engine i; ranks without an engine join the gathers.
        With a single engine only rank 0 needs full tensors, so shards are gathered to it alone."""
        gather_dst = 0 if len(engine_urls) == 1 else None
        calls = [
            worker.sync_weights.remote(
                engine_urls[rank] if rank < len(engine_urls) else None,
                engine_tp_size, bucket_bytes, weight_version, gather_dst,
            )
            for rank, worker in enumerate(self.workers)
        ]
        return ray.get(calls)

    def loss_gradients(self, sequences: list[TrainSequence]) -> dict:
        shares = self._shares(sequences)
        return ray.get([w.loss_gradients.remote(s) for w, s in zip(self.workers, shares, strict=True)])[0]

    def compute_sequence_kl(self, sequences: list[TrainSequence]) -> list[float]:
        shares = self._shares(sequences)
        results = ray.get([w.compute_sequence_kl.remote(s) for w, s in zip(self.workers, shares, strict=True)])
        return [kl for share in results for kl in share]

    def sleep(self) -> dict:
        """Offload every rank; returns summed bytes and the slowest rank's seconds."""
        return _combine(ray.get([w.sleep.remote() for w in self.workers]))

    def wake_up(self) -> dict:
        return _combine(ray.get([w.wake_up.remote() for w in self.workers]))

    def save_checkpoint(self, directory: str) -> None:
        ray.get([w.save_checkpoint.remote(directory) for w in self.workers])

    def load_checkpoint(self, directory: str) -> None:
        ray.get([w.load_checkpoint.remote(directory) for w in self.workers])

    def host_memory_bytes(self) -> list[int]:
        return ray.get([w.host_memory_bytes.remote() for w in self.workers])

    def health(self, timeout_s: float = 10.0) -> list[dict]:
        """Per rank: alive and host memory; an actor that does not answer reads as not alive."""
        reports = []
        for rank, worker in enumerate(self.workers):
            try:
                reports.append({"rank": rank, "alive": True,
                                "memory_bytes": ray.get(worker.host_memory_bytes.remote(), timeout=timeout_s)})
            except Exception as error:  # noqa: BLE001 - the actor itself may be gone
                reports.append({"rank": rank, "alive": False, "memory_bytes": None, "error": str(error)[:200]})
        return reports

    def connect_broadcast(self, engine_urls: list[str], engine_tp_size: int, timeout_s: float) -> None:
        ray.get(self.workers[0].connect_broadcast.remote([(url, engine_tp_size) for url in engine_urls], timeout_s))

    def sync_weights_broadcast(self, bucket_bytes: int, weight_version: int) -> list[dict]:
        return ray.get([w.sync_weights_broadcast.remote(bucket_bytes, weight_version) for w in self.workers])

    def vocab_size(self) -> int:
        return ray.get(self.workers[0].vocab_size.remote())

    def full_state_dict(self) -> dict:
        return ray.get([w.full_state_dict.remote() for w in self.workers])[0]

    def shutdown(self) -> None:
        try:
            ray.get([w.shutdown.remote() for w in self.workers], timeout=30)
        except Exception:  # noqa: BLE001 - a dead rank must not stop the others from being killed
            pass
        for worker in self.workers:
            ray.kill(worker)
        self.workers = []


def _combine(reports: list[dict]) -> dict:
    return {"bytes": sum(r["bytes"] for r in reports), "seconds": max(r["seconds"] for r in reports)}
