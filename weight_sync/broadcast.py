"""Disaggregated transport: trainer rank 0 broadcasts weight buckets to every engine worker over a
dedicated process group (NCCL on GPU, gloo on CPU) that never touches the trainers' own group.

Order, chosen so that nothing can wait forever:
- group set-up: the `/init_weights_update_group` calls go out first (each blocks in the engine
  until the group forms), then rank 0 joins as rank 0; a member that never arrives ends in a
  TimeoutError that names it;
- per bucket: `/update_weights_from_distributed` goes out first (the engine allocates the bucket
  and waits in the broadcast), then rank 0 broadcasts; the broadcast itself has a timeout.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from weight_sync.backend import Backend
from weight_sync.buckets import WeightBucket
from weight_sync.colocated import StagingBuffer
from weight_sync.http import EngineHTTPError, post_json


@dataclass(frozen=True)
class EngineEndpoint:
    url: str
    tp_size: int = 1


class WeightSyncTimeout(TimeoutError):
    """An engine did not join the weight-update group or receive a bucket in time."""


def new_custom_process_group(backend: str, master_address: str, master_port: int, rank: int, world_size: int,
                             group_name: str, timeout: timedelta):
    """A process group outside the default one, rendezvousing exactly as SGLang's engine side does
    (tcp:// rendezvous, PrefixStore(group_name), torch's group helper), so the two always match."""
    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world, rendezvous

    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                              timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(world_size, rank, [], dist.Backend(backend), store,
                                         group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


@dataclass
class _Calls:
    """HTTP calls running on threads while this process takes part in a collective."""

    results: dict = field(default_factory=dict)
    threads: list = field(default_factory=list)

    def start(self, key: str, url: str, payload: dict, timeout_s: float) -> None:
        def call():
            try:
                answer = post_json(url, payload, timeout_s=timeout_s)
                if isinstance(answer, dict) and answer.get("success") is False:
                    raise EngineHTTPError(f"{url}: {answer.get('message')}")
                self.results[key] = None
            except Exception as error:  # noqa: BLE001 - reported by wait()
                self.results[key] = error

        thread = threading.Thread(target=call, daemon=True)
        thread.start()
        self.threads.append((key, thread))

    def wait(self, timeout_s: float) -> dict[str, Exception | None]:
        for _, thread in self.threads:
            thread.join(timeout=timeout_s)
        return {key: self.results.get(key, TimeoutError("no answer")) for key, _ in self.threads}


class BroadcastWeightSender:
    """Trainer rank 0's side of the weight-update group."""

    alignment = 1  # SGLang's receiver lays tensors out back to back

    def __init__(self, engines: list[EngineEndpoint], backend: Backend, master_address: str,
                 timeout_s: float = 120.0):
        self.engines = engines
        self.backend = backend
        self.master_address = master_address
        self.timeout_s = timeout_s
        self.group_name = f"rlsys-weights-{uuid.uuid4().hex[:8]}"
        self.group = None
        self._staging = StagingBuffer(share_memory=False)

    def staging_buffer(self, nbytes: int, device):
        return self._staging.get(nbytes, device)

    def connect(self) -> None:
        import socket

        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        world_size = 1 + sum(e.tp_size for e in self.engines)
        calls, offset = _Calls(), 1
        for engine in self.engines:
            calls.start(engine.url, f"{engine.url}/init_weights_update_group", {
                "master_address": self.master_address, "master_port": port, "rank_offset": offset,
                "world_size": world_size, "group_name": self.group_name, "backend": self.backend.dist_backend,
            }, timeout_s=self.timeout_s + 30)
            offset += engine.tp_size
        try:
            self.group = new_custom_process_group(
                self.backend.dist_backend, self.master_address, port, 0, world_size, self.group_name,
                timedelta(seconds=self.timeout_s),
            )
        except Exception as error:  # noqa: BLE001 - the store raises a generic error on timeout
            outcome = calls.wait(1.0)
            refused = {url: str(result)[:200] for url, result in outcome.items() if isinstance(result, EngineHTTPError)}
            waiting = [url for url, result in outcome.items() if result is not None and url not in refused]
            named = ", ".join(refused) if refused else ", ".join(waiting)
            raise WeightSyncTimeout(
                f"weight-update group: engine {named} did not join within {self.timeout_s:.0f}s "
                f"(weight_sync.timeout_s); its init_weights_update_group call: {refused or 'no answer'}; "
                f"store error: {error}"
            ) from error
        failed = {url: result for url, result in calls.wait(self.timeout_s).items() if result is not None}
        if failed:
            raise WeightSyncTimeout(f"weight-update group: engine(s) failed to join: {failed}")

    def _post_all(self, path: str, payload: dict) -> None:
        calls = _Calls()
        for engine in self.engines:
            calls.start(engine.url, f"{engine.url}{path}", payload, self.timeout_s)
        failed = {url: result for url, result in calls.wait(self.timeout_s).items() if result is not None}
        if failed:
            raise EngineHTTPError(f"{path} failed on {failed}")

    def begin(self) -> None:
        self._post_all("/begin_weight_update", {})

    def end(self) -> None:
        self._post_all("/end_weight_update", {})

    def send_bucket(self, bucket: WeightBucket, flush_cache: bool, weight_version: str | None) -> None:
        calls = _Calls()
        payload = {
            "names": [m.name for m in bucket.metas],
            "dtypes": [str(m.dtype).removeprefix("torch.") for m in bucket.metas],
            "shapes": [list(m.shape) for m in bucket.metas],
            "group_name": self.group_name,
            "load_format": "flattened_bucket",
            "flush_cache": flush_cache,
            "weight_version": weight_version,
        }
        for engine in self.engines:
            calls.start(engine.url, f"{engine.url}/update_weights_from_distributed", payload, self.timeout_s)
        work = dist.broadcast(bucket.buffer, src=0, group=self.group, async_op=True)
        try:
            work.wait(timedelta(seconds=self.timeout_s))
        except Exception as error:  # noqa: BLE001 - gloo/nccl raise their own error types on timeout
            raise WeightSyncTimeout(f"broadcast of a weight bucket did not complete: {error}") from error
        failed = {url: result for url, result in calls.wait(self.timeout_s).items() if result is not None}
        if failed:
            raise EngineHTTPError(f"/update_weights_from_distributed failed on {failed}")

    def close(self) -> None:
        if self.group is None:
            return
        for engine in self.engines:
            try:
                post_json(f"{engine.url}/destroy_weights_update_group", {"group_name": self.group_name},
                          timeout_s=30)
            except EngineHTTPError:
                pass  # the engine may already be gone
        dist.destroy_process_group(self.group)
        self.group = None
        self._staging.release()

