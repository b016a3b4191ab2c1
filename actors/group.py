"""`TrainerGroup`: N TrainerWorker ranks as Ray actors, driven as one trainer."""

from __future__ import annotations

from dataclasses import replace

import ray

from rlsys.actors.batching import split_evenly
from rlsys.actors.trainer import TrainerSpec, TrainerWorker
from rlsys.algorithms.losses import sequence_loss_weights
from rlsys.records import TrainSequence
from rlsys.system.topology import Topology


class TrainerGroup:
    def __init__(self, spec: TrainerSpec, num_ranks: int, actor_options: list[dict] | None = None,
                 env_vars: dict[str, str] | None = None, worker_cls: type = TrainerWorker):
        self.spec = spec
        self.num_ranks = num_ranks
        self.asleep = False
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
        self.nodes = ray.get([worker.node_address.remote() for worker in self.workers])  # rank -> node address
        ray.get([worker.setup.remote(address, port) for worker in self.workers])

    def _shares(self, sequences: list[TrainSequence]) -> list[list[TrainSequence]]:
        return split_evenly(sequences, self.num_ranks)

    def compute_log_probs(self, sequences: list[TrainSequence], reference: bool = False,
                          temperature: float | None = None) -> list[list[float]]:
        shares = self._shares(sequences)
        results = ray.get([w.compute_log_probs.remote(s, reference, temperature)
                           for w, s in zip(self.workers, shares, strict=False)])
        return [logprobs for share in results for logprobs in share]

    def train_step(self, sequences: list[TrainSequence]) -> dict[str, float]:
        """Split into `mini_batches_per_step` global mini-batches, then each over the ranks."""
        minis = global_mini_batches(sequences, self.spec)
        per_rank = [[split_evenly(mini, self.num_ranks)[rank] for mini in minis] for rank in range(self.num_ranks)]
        results = ray.get([w.train_step.remote(parts) for w, parts in zip(self.workers, per_rank, strict=True)])
        return results[0]  # metrics are all-reduced: every rank returns the same

    def connect_engines(self, topology: Topology, timeout_s: float) -> None:
        """Give each rank its weight transport to the engines in `topology` (see TrainerWorker)."""
        ray.get([w.connect_engines.remote(topology, timeout_s) for w in self.workers])

    def sync_weights(self, bucket_bytes: int, weight_version: int, pipelined: bool = True) -> list[dict]:
        """Trainer weights into the engines of the last `connect_engines`; per-rank statistics
        (weight_sync.sync.SyncStats)."""
        return ray.get([w.sync_weights.remote(bucket_bytes, weight_version, pipelined) for w in self.workers])

    def loss_gradients(self, sequences: list[TrainSequence]) -> dict:
        """Gradients of the loss of `sequences` as one mini-batch (tests)."""
        shares = self._shares(weighed(sequences, self.spec))
        return ray.get([w.loss_gradients.remote(s) for w, s in zip(self.workers, shares, strict=True)])[0]

    def compute_sequence_kl(self, sequences: list[TrainSequence]) -> list[float]:
        shares = self._shares(sequences)
        results = ray.get([w.compute_sequence_kl.remote(s) for w, s in zip(self.workers, shares, strict=True)])
        return [kl for share in results for kl in share]

    def sleep(self) -> dict:
        """Offload every rank; returns summed bytes and the slowest rank's seconds."""
        report = _combine(ray.get([w.sleep.remote() for w in self.workers]))
        self.asleep = True
        return report

    def release_cached_memory(self) -> dict:
        """Every rank returns its cached free device blocks; the most any rank still holds."""
        held = [r["held_bytes"] for r in ray.get([w.release_cached_memory.remote() for w in self.workers])]
        return {"held_bytes": max(held) if held else None}

    def wake_up(self) -> dict:
        report = _combine(ray.get([w.wake_up.remote() for w in self.workers]))
        self.asleep = False
        return report

    def save_checkpoint(self, directory: str) -> None:
        ray.get([w.save_checkpoint.remote(directory) for w in self.workers])

    def load_checkpoint(self, directory: str) -> None:
        ray.get([w.load_checkpoint.remote(directory) for w in self.workers])

    def load_memory_reports(self) -> list[dict]:
        return ray.get([w.load_memory_report.remote() for w in self.workers])

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

    def describe(self) -> dict:
        return ray.get(self.workers[0].describe.remote())

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


def weighed(mini_batch: list[TrainSequence], spec: TrainerSpec) -> list[TrainSequence]:
    """Copies carrying each sequence's token weight in this global mini-batch's loss."""
    weights = sequence_loss_weights([s.loss_tokens for s in mini_batch], spec.algorithm.aggregation,
                                    spec.loss_norm_tokens)
    return [replace(s, loss_weight=w) for s, w in zip(mini_batch, weights, strict=True)]


def global_mini_batches(sequences: list[TrainSequence], spec: TrainerSpec) -> list[list[TrainSequence]]:
    """A step's batch as its `mini_batches_per_step` global mini-batches (contiguous, in order), each
    sequence weighed for its mini-batch's loss: what every rank count splits further the same way."""
    return [weighed(mini, spec) for mini in split_evenly(sequences, spec.trainer.mini_batches_per_step)]


def _combine(reports: list[dict]) -> dict:
    """Bytes moved by all ranks, the slowest rank's seconds, and the most any rank holds after."""
    held = [r["held_bytes"] for r in reports if r.get("held_bytes") is not None]
    return {"bytes": sum(r["bytes"] for r in reports), "seconds": max(r["seconds"] for r in reports),
            "held_bytes": max(held) if held else None}
