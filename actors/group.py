"""`TrainerGroup`: N TrainerWorker ranks as Ray actors, driven as one trainer."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

import ray

from rlsys.actors.batching import balanced_partition, split_evenly
from rlsys.actors.trainer import TrainerSpec, TrainerWorker
from rlsys.algorithms.losses import sequence_loss_weights
from rlsys.config import ConfigError
from rlsys.model.shape import ModelShape
from rlsys.records import TrainSequence
from rlsys.system.topology import Topology


class TrainerHang(Exception):
    """Trainer ranks that did not answer a call within trainer.call_timeout_s (a rank stopped or
    deadlocked, the others waiting for it in a collective). `detail`: where each rank was
    (rlsys/system/stacks.py), when the group's `events` collected it."""

    def __init__(self, what: str, ranks: list[int], timeout_s: float, detail: str = ""):
        self.what, self.ranks, self.timeout_s, self.detail = what, ranks, timeout_s, detail
        super().__init__(f"trainer rank(s) {', '.join(map(str, ranks))} did not finish {what} within {timeout_s:g} s "
                         f"(trainer.call_timeout_s){': ' + detail if detail else ''}")


class TrainerEvents(Protocol):
    """What a TrainerGroup reports while it runs (a run's answers: rlsys/run/events.py)."""

    def trainer_hung(self, what: str, ranks: list[int]) -> str:
        """`ranks` did not finish `what` within trainer.call_timeout_s, before TrainerHang is raised;
        returns where each rank was (the run collects every process's stacks)."""


class TrainerGroup:
    def __init__(self, spec: TrainerSpec, num_ranks: int, actor_options: list[dict] | None = None,
                 env_vars: dict[str, str] | None = None, worker_cls: type = TrainerWorker,
                 judge_model: Callable[[ModelShape], bool | None] | None = None, warm: list | None = None,
                 keep: Callable[[], bool] | None = None, events: TrainerEvents | None = None):
        """`judge_model`: called with the model's shapes rank 0 reports (`TrainerWorker.model_report`)
        before any rank builds its model (the run's memory plan); what it raises, or rank 0's refusal
        of the model (a ConfigError), stops the ranks and is raised here; what it returns places the
        reference model (True: on the device, False: on the host, None: as the spec says). `warm`: running ranks of a
        process group (a standing set's, actors/warm_ranks.py) that take `spec` instead of new
        ones. `keep`: whether `shutdown` leaves the ranks up, released, asked then (never after a call
        to them failed); None: they are stopped. `events`: told of a hang (`TrainerEvents`)."""
        self.spec = spec
        self.num_ranks = num_ranks
        self.asleep = False
        self.keep = keep
        self.events = events
        self.hung = False
        self.failed = False  # a call to the ranks raised: they may be anywhere in a collective
        if warm is not None:
            self.workers = list(warm)
            self.processes = ray.get([worker.process.remote() for worker in self.workers])
            self.nodes = [address for _, _, address in self.processes]
            self._on_every_rank("respec", replace(spec), bounded=False)
            if judge_model is not None:
                self._judge_model(judge_model)
            self._wait([worker.build.remote() for worker in self.workers], "build")
            return
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
        self.processes = ray.get([worker.process.remote() for worker in self.workers])  # rank -> (pid, node id, address)
        self.nodes = [address for _, _, address in self.processes]  # rank -> node address
        if judge_model is not None:
            self._judge_model(judge_model)
        ray.get([worker.setup.remote(address, port) for worker in self.workers])

    def _judge_model(self, judge: Callable[[ModelShape], bool | None]) -> None:
        try:
            # Every rank reads the model at once, so each imports the modeling code in parallel, as
            # `setup` would; rank 0's answer is the one judged.
            shape, refusal = ray.get([worker.model_report.remote() for worker in self.workers])[0]
            if refusal is not None:
                raise ConfigError(refusal)
            on_device = judge(shape)
            if on_device is not None and on_device != self.spec.reference_on_device:
                # the plan placed the reference (trainer.reference_placement auto): the ranks take that
                # spec before they build anything
                self.spec = replace(self.spec, reference_on_device=on_device)
                self._on_every_rank("place_reference", on_device, bounded=False)
        except BaseException:
            self.shutdown()
            raise

    def _wait(self, calls: list, what: str) -> list:
        """The ranks' answers to one call each, within trainer.call_timeout_s (TrainerHang past it; a
        rank that failed meanwhile raises its error, as ray.get would)."""
        try:
            return self._answers(calls, what)
        except BaseException:
            self.failed = True
            raise

    def _answers(self, calls: list, what: str) -> list:
        timeout_s = self.spec.trainer.call_timeout_s
        if timeout_s is None:
            return ray.get(calls)
        deadline = time.monotonic() + timeout_s
        pending = list(calls)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            ray.get(ready)  # a rank that failed raises at once (the others may wait for it in a collective)
        if pending:
            ranks = [calls.index(call) for call in pending]
            self.hung = True  # its ranks will not answer a shutdown either
            detail = self.events.trainer_hung(what, ranks) if self.events is not None else ""
            raise TrainerHang(what, ranks, timeout_s, detail)
        return ray.get(calls)

    def _on_every_rank(self, method: str, *args, bounded: bool = True) -> list:
        """The worker's `method(*args)` on every rank at once; their answers in rank order. Bounded:
        within trainer.call_timeout_s, stacks collected on a hang (`_wait`); else as long as it takes
        (quick bookkeeping calls, and connect_engines, which has its own timeout)."""
        calls = [getattr(worker, method).remote(*args) for worker in self.workers]
        if bounded:
            return self._wait(calls, method)
        try:
            return ray.get(calls)
        except BaseException:
            self.failed = True
            raise

    @property
    def _context_parallel_size(self) -> int:
        return self.spec.trainer.context_parallel_size

    def _shares(self, sequences: list[TrainSequence]) -> list[list[int]]:
        """Per rank, the indices of the sequences it takes (see `rank_shares`)."""
        return rank_shares([len(s.token_ids) for s in sequences], self.num_ranks, self._context_parallel_size)

    def _per_sequence(self, method: str, sequences: list[TrainSequence], *args) -> list:
        """`method`'s per-sequence results from the ranks, in the caller's order: each sequence's
        from the first rank of the group that took it (a CP group's ranks return the same)."""
        shares = self._shares(sequences)
        results = self._wait([getattr(w, method).remote([sequences[i] for i in share], *args)
                              for w, share in zip(self.workers, shares, strict=True)], method)
        ordered: list = [None] * len(sequences)
        for rank in range(0, self.num_ranks, self._context_parallel_size):
            for index, result in zip(shares[rank], results[rank], strict=True):
                ordered[index] = result
        return ordered

    def compute_log_probs(self, sequences: list[TrainSequence], reference: bool = False,
                          temperature: float | None = None) -> list[list[float]]:
        return self._per_sequence("compute_log_probs", sequences, reference, temperature)

    def train_step(self, sequences: list[TrainSequence]) -> dict[str, float]:
        """Split into `mini_batches_per_step` global mini-batches, then each over the ranks by tokens."""
        minis = global_mini_batches(sequences, self.spec)
        shares = [self._shares(mini) for mini in minis]
        per_rank = [[[mini[i] for i in share[rank]] for mini, share in zip(minis, shares, strict=True)]
                    for rank in range(self.num_ranks)]
        results = self._wait([w.train_step.remote(parts) for w, parts in zip(self.workers, per_rank, strict=True)],
                             "train_step")
        group_tokens = [[sum(len(mini[i].token_ids) for i in share[rank])
                         for rank in range(0, self.num_ranks, self._context_parallel_size)]
                        for mini, share in zip(minis, shares, strict=True)]
        # metrics are all-reduced: every rank returns the same
        return {**results[0], "rank_token_imbalance": token_imbalance(group_tokens)}

    def connect_engines(self, topology: Topology, timeout_s: float) -> None:
        """Give each rank its weight transport to the engines in `topology` (see TrainerWorker)."""
        self._on_every_rank("connect_engines", topology, timeout_s, bounded=False)

    def sync_weights(self, bucket_bytes: int, weight_version: int, pipelined: bool = True) -> list[dict]:
        """Trainer weights into the engines of the last `connect_engines`; per-rank statistics
        (weight_sync.sync.SyncStats)."""
        return self._on_every_rank("sync_weights", bucket_bytes, weight_version, pipelined)

    def compute_sequence_kl(self, sequences: list[TrainSequence]) -> list[float]:
        return self._per_sequence("compute_sequence_kl", sequences)

    def sleep(self) -> dict:
        """Offload every rank; returns summed bytes and the slowest rank's seconds."""
        report = _combine(self._on_every_rank("sleep"))
        self.asleep = True
        return report

    def release_cached_memory(self) -> dict:
        """Every rank returns its cached free device blocks; the most any rank still holds."""
        held = [r["held_bytes"] for r in self._on_every_rank("release_cached_memory", bounded=False)]
        return {"held_bytes": max(held) if held else None}

    def wake_up(self) -> dict:
        report = _combine(self._on_every_rank("wake_up"))
        self.asleep = False
        return report

    def save_checkpoint(self, directory: str) -> None:
        self._on_every_rank("save_checkpoint", directory)

    def load_checkpoint(self, directory: str) -> None:
        self._on_every_rank("load_checkpoint", directory)

    def host_memory_bytes(self) -> list[int]:
        return self._on_every_rank("host_memory_bytes", bounded=False)

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

    def start_profile(self) -> None:
        """Every rank starts recording torch.profiler (profile.steps)."""
        self._on_every_rank("start_profile", bounded=False)

    def stop_profile(self, directory: str, timeout_s: float | None = None) -> list[str]:
        """Every rank stops and writes its trace into `directory`; the files written."""
        answers = ray.get([w.stop_profile.remote(directory) for w in self.workers], timeout=timeout_s)
        return [path for paths in answers for path in paths]

    def describe(self) -> dict:
        return ray.get(self.workers[0].describe.remote())

    def vocab_size(self) -> int:
        return ray.get(self.workers[0].vocab_size.remote())

    def shutdown(self) -> None:
        """Stop the ranks; a group kept (`keep`) whose calls all succeeded is released instead, its
        processes left up for the next run."""
        if self.keep is not None and not (self.hung or self.failed) and self.keep():
            try:
                ray.get([w.release.remote() for w in self.workers], timeout=30)
                self.workers = []
                return
            except Exception:  # noqa: BLE001 - a rank that cannot be released is stopped with the rest
                pass
        try:
            if not self.hung:
                ray.get([w.shutdown.remote() for w in self.workers], timeout=30)
        except Exception:  # noqa: BLE001 - a dead rank must not stop the others from being killed
            pass
        for worker in self.workers:
            ray.kill(worker)
        self.workers = []


def rank_shares(costs: list[int], num_ranks: int, context_parallel_size: int = 1) -> list[list[int]]:
    """Per rank, the (ascending) indices of the sequences it takes: a cost-balanced partition over the
    num_ranks / CP data-parallel groups, each group's sequences going to every one of its CP
    consecutive ranks (rank r is in group r // CP).

    The cost is a sequence's tokens, not its attention cost (len^2): the linear layers, the output
    layer's log-probs over the vocabulary and the activations kept for the backward (varlen
    flash-attn keeps no L x L matrix) all grow with tokens, and they outweigh attention (about
    4 L^2 d FLOPs a layer against 24 L d^2 or more) until L passes ~6 d, some 20k tokens at
    d = 3584; micro-batches are cut by a token budget too, so equal tokens also give the ranks
    near-equal micro-batch counts.
    """
    if context_parallel_size < 1 or num_ranks % context_parallel_size:
        raise ValueError(f"context_parallel_size ({context_parallel_size}) must divide the ranks ({num_ranks})")
    groups = balanced_partition(costs, num_ranks // context_parallel_size)
    return [groups[rank // context_parallel_size] for rank in range(num_ranks)]


def token_imbalance(group_tokens: list[list[int]]) -> float:
    """max / mean of the data-parallel groups' tokens in a step, from each mini-batch's per-group
    tokens: sum over mini-batches of the heaviest group's tokens (each optimizer step waits for its
    slowest group) over the sum of their means. 1.0 is balanced (and for an empty step)."""
    heaviest = sum(max(tokens) for tokens in group_tokens if tokens)
    mean = sum(sum(tokens) / len(tokens) for tokens in group_tokens if tokens)
    return heaviest / mean if mean else 1.0


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
