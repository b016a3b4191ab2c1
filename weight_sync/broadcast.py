"""Disaggregated transport: trainer rank 0 broadcasts weight buckets to every engine worker over a
dedicated process group (NCCL on GPU, gloo on CPU) that never touches the trainers' own group.

Order, chosen so that nothing can wait forever:
- group set-up: the `/init_weights_update_group` calls go out first (each blocks in the engine
  until the group forms), then rank 0 joins as rank 0; a member that never arrives ends in a
  TimeoutError that names it;
- per bucket: `/update_weights_from_distributed` goes out first (the engine allocates the bucket
  and waits in the broadcast), then rank 0 broadcasts. This process watches the broadcast itself
  (`Work.is_completed`, polled) rather than trusting `work.wait(timeout)`, which on NCCL only
  orders the device stream and never times out on the host: an engine whose call fails, or a
  broadcast still running after `weight_sync.timeout_s`, aborts the group and raises naming the
  engines, on NCCL as on gloo.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol

import torch.distributed as dist

from rlsys.system.backend import Backend
from rlsys.system.rendezvous import ReservedPort, rank_store
from rlsys.weight_sync.buckets import WeightBucket
from rlsys.weight_sync.call_queue import EngineCallQueue
from rlsys.weight_sync.colocated import StagingSlots


class BroadcastEndpoints(Protocol):
    """The engine endpoints this transport needs (`rlsys.rollout.sglang.client.SGLangClient` has them)."""

    name: str
    tp_size: int

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str, timeout_s: float | None = None) -> None: ...
    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str, flush_cache: bool, weight_version: str | None,
                                        timeout_s: float | None = None) -> None: ...
    def begin_weight_update(self) -> None: ...
    def end_weight_update(self) -> None: ...
    def destroy_weights_update_group(self, group_name: str) -> None: ...


class WeightSyncError(RuntimeError):
    """An engine refused a step of the broadcast sync; the message names it."""


class WeightSyncTimeout(TimeoutError):
    """An engine did not join the weight-update group or receive a bucket in time."""


def new_custom_process_group(backend: str, master_address: str, master_port: int, rank: int, world_size: int,
                             group_name: str, timeout: timedelta, reserved: ReservedPort | None = None):
    """A process group outside the default one, meeting as SGLang's engine side does (a `tcp://`
    store at master_address:master_port, PrefixStore(group_name), torch's group helper), so the two
    always match. Rank 0 serves the store, on `reserved` when it holds that port."""
    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world

    store = rank_store(rank, master_address, master_port, world_size, timeout, reserved)
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(world_size, rank, [], dist.Backend(backend), store,
                                         group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


@dataclass
class _Calls:
    """Engine calls running on threads while this process takes part in a collective."""

    results: dict = field(default_factory=dict)
    threads: list = field(default_factory=list)

    def start(self, engine: str, call: Callable[[], None]) -> None:
        def run():
            try:
                call()
                self.results[engine] = None
            except Exception as error:  # noqa: BLE001 - reported by wait()
                self.results[engine] = error

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self.threads.append((engine, thread))

    def wait(self, timeout_s: float) -> dict[str, Exception | None]:
        for _, thread in self.threads:
            thread.join(timeout=timeout_s)
        return {engine: self.results.get(engine, TimeoutError("no answer")) for engine, _ in self.threads}

    def failures(self, timeout_s: float) -> dict[str, Exception]:
        return {engine: result for engine, result in self.wait(timeout_s).items() if result is not None}

    def failed_so_far(self) -> dict[str, Exception]:
        """Calls that have already answered with an error (without waiting for the others)."""
        return {engine: result for engine, result in list(self.results.items()) if result is not None}

    def unanswered(self) -> list[str]:
        return [engine for engine, thread in self.threads if thread.is_alive()]


def wait_for_collective(work, calls: _Calls, timeout_s: float, what: str, abort: Callable[[], None],
                        poll_s: float = 0.002) -> None:
    """Block until `work` completes on the host, or fail fast: an engine call that fails, or
    `timeout_s` passing, aborts the group (`abort`) and raises naming the engines."""
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        failed = calls.failed_so_far()
        if failed:
            abort()
            raise WeightSyncError(f"{what}: the engine side failed on {sorted(failed)}: "
                                  f"{ {name: str(error)[:300] for name, error in failed.items()} }")
        if time.monotonic() > deadline:
            abort()
            raise WeightSyncTimeout(f"{what} did not complete within {timeout_s:.0f}s (weight_sync.timeout_s); "
                                    f"no answer from {calls.unanswered() or 'any engine'}")
        time.sleep(poll_s)
    raise_if_failed(work, what)


def raise_if_failed(work, what: str) -> None:
    """Raise if a completed collective failed. `Work.wait()` is the one check every backend
    implements: on a completed work it returns at once, or raises the collective's error (gloo
    rethrows it; NCCL's WorkNCCL::wait handles the exception its isCompleted recorded).
    `Work.is_success()` is not: ProcessGroupNCCL's WorkNCCL::isSuccess() throws
    NotImplementedError("WorkNCCL::isSuccess() is deprecated"), so it failed every NCCL sync."""
    try:
        work.wait()
    except Exception as error:  # noqa: BLE001 - the backend's own error type
        raise WeightSyncError(f"{what} failed: {error}") from error


class BroadcastWeightSender:
    """Trainer rank 0's side of the weight-update group."""

    alignment = 1  # SGLang's receiver lays tensors out back to back

    def __init__(self, engines: list[BroadcastEndpoints], backend: Backend, master_address: str,
                 timeout_s: float = 120.0):
        self.engines = engines
        self.backend = backend
        self.master_address = master_address
        self.timeout_s = timeout_s
        self.group_name = f"rlsys-weights-{uuid.uuid4().hex[:8]}"
        self.group = None
        self._staging = StagingSlots(share_memory=False)
        # The engine calls and each bucket's broadcast run in order on a thread of their own, so the
        # sync gathers the next bucket meanwhile (weight_sync/sync.py).
        self._queue = EngineCallQueue("rlsys-broadcast-sync")

    def staging_buffer(self, slot: int, nbytes: int, device):
        return self._staging.get(slot, nbytes, device)

    @property
    def staging_nbytes(self) -> int:
        return self._staging.nbytes

    def release_staging_buffer(self) -> None:
        self._staging.release()

    def connect(self) -> None:
        reserved = ReservedPort()  # held until this rank's store serves it: no one can take it meanwhile
        port = reserved.port
        world_size = 1 + sum(e.tp_size for e in self.engines)
        calls, offset = _Calls(), 1
        for engine in self.engines:
            calls.start(engine.name, lambda engine=engine, offset=offset: engine.init_weights_update_group(
                self.master_address, port, offset, world_size, self.group_name, self.backend.dist_backend,
                timeout_s=self.timeout_s + 30))
            offset += engine.tp_size
        try:
            self.group = new_custom_process_group(
                self.backend.dist_backend, self.master_address, port, 0, world_size, self.group_name,
                timedelta(seconds=self.timeout_s), reserved,
            )
        except Exception as error:  # noqa: BLE001 - the store raises a generic error on timeout
            outcome = calls.wait(1.0)
            refused = {name: str(result)[:200] for name, result in outcome.items()
                       if result is not None and not isinstance(result, TimeoutError)}
            waiting = [name for name, result in outcome.items() if result is not None and name not in refused]
            named = ", ".join(refused) if refused else ", ".join(waiting)
            raise WeightSyncTimeout(
                f"weight-update group: {named} did not join within {self.timeout_s:.0f}s "
                f"(weight_sync.timeout_s); its init_weights_update_group call: {refused or 'no answer'}; "
                f"store error: {error}"
            ) from error
        failed = calls.failures(self.timeout_s)
        if failed:
            raise WeightSyncTimeout(f"weight-update group: engine(s) failed to join: {failed}")

    def _on_every_engine(self, what: str, call: Callable[[BroadcastEndpoints], None]) -> None:
        calls = _Calls()
        for engine in self.engines:
            calls.start(engine.name, lambda engine=engine: call(engine))
        failed = calls.failures(self.timeout_s)
        if failed:
            raise WeightSyncError(f"{what} failed on {failed}")

    def begin(self) -> Future:
        self._queue.reset()
        return self._queue.submit(lambda: self._on_every_engine("/begin_weight_update",
                                                                lambda engine: engine.begin_weight_update()))

    def end(self) -> Future:
        return self._queue.submit(lambda: self._on_every_engine("/end_weight_update",
                                                                lambda engine: engine.end_weight_update()),
                                  always=True)

    def send_bucket(self, bucket: WeightBucket, flush_cache: bool, weight_version: str | None) -> Future:
        """Queues the bucket's broadcast; its future completes once every engine has loaded it."""
        return self._queue.submit(lambda: self._broadcast(bucket, flush_cache, weight_version))

    def _broadcast(self, bucket: WeightBucket, flush_cache: bool, weight_version: str | None) -> None:
        if self.group is None:
            raise WeightSyncError("the weight-update group was torn down after an earlier failure; "
                                  "connect the engines again before the next sync")
        names = [m.name for m in bucket.metas]
        dtypes = [str(m.dtype).removeprefix("torch.") for m in bucket.metas]
        shapes = [list(m.shape) for m in bucket.metas]
        calls = _Calls()
        for engine in self.engines:
            calls.start(engine.name, lambda engine=engine: engine.update_weights_from_distributed(
                names, dtypes, shapes, self.group_name, flush_cache, weight_version, timeout_s=self.timeout_s))
        self.backend.use_device_on_this_thread(bucket.buffer.device)  # launched from the queue's thread
        work = dist.broadcast(bucket.buffer, src=0, group=self.group, async_op=True)
        try:
            wait_for_collective(work, calls, self.timeout_s, "broadcast of a weight bucket", self._abort)
        except RuntimeError as error:  # the backend's own error (e.g. a peer's connection closed)
            if isinstance(error, (WeightSyncError, WeightSyncTimeout)):
                raise
            failed = calls.failures(1.0)
            raise WeightSyncError(f"broadcast of a weight bucket failed ({error}); engines: {failed}") from error
        failed = calls.failures(self.timeout_s)
        if failed:
            raise WeightSyncError(f"/update_weights_from_distributed failed on {failed}")

    def _abort(self) -> None:
        """Tear the group down without waiting for its members (NCCL aborts its communicators;
        gloo's pending calls end by its own group timeout)."""
        group, self.group = self.group, None
        if group is None:
            return
        try:
            group.abort()
        except Exception:  # noqa: BLE001 - not every backend implements abort
            pass
        self.release_staging_buffer()

    def close(self) -> None:
        self._queue.close()
        if self.group is None:
            return
        for engine in self.engines:
            try:
                engine.destroy_weights_update_group(self.group_name)
            except Exception:  # noqa: BLE001 - the engine may already be gone
                pass
        dist.destroy_process_group(self.group)
        self.group = None
        self.release_staging_buffer()
