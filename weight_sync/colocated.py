"""Colocated transport: hand weight buckets to an SGLang engine on the same node by IPC handle.

A bucket travels as its tensors' views into the staging buffer, pickled with torch's
multiprocessing reductions: a CUDA IPC handle for GPU memory, a shared-memory file name for host
memory (`Backend.prepare_ipc`), plus each view's offset and shape. The engine maps the same memory
instead of receiving bytes and loads it with `weight_sync.engine_loader` (why not SGLang's own
`flattened_bucket` loader: see that module). The handle must stay alive until the engine has
loaded it: `/update_weights_from_tensor` answers only after the load.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # noqa: F401 - registers torch's tensor reductions with ForkingPickler

from weight_sync.buckets import WeightBucket
from weight_sync.engine_loader import LOAD_FORMAT
from weight_sync.http import post_json


class StagingBuffer:
    """One reusable bucket-sized buffer: every bucket of every sync is flattened into it.

    Reuse keeps the extra memory at one bucket and avoids first-touch page faults of fresh memory
    (2-5 GB/s here against 14-18 GB/s for warm copies); the engine maps the same pages each time.
    CPU buffers live in shared memory so they travel as handles (the twin of CUDA IPC)."""

    def __init__(self, share_memory: bool):
        self.share_memory = share_memory
        self._buffer: torch.Tensor | None = None

    def staging_buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return self.get(nbytes, device)

    def get(self, nbytes: int, device: torch.device) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < nbytes or self._buffer.device != device:
            self._buffer = None
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
            if self.share_memory and device.type == "cpu":
                buffer.share_memory_()
            self._buffer = buffer
        return self._buffer

    def release(self) -> None:
        self._buffer = None


def serialize_bucket(bucket: WeightBucket) -> str:
    """A base64 payload of (name, view) pairs: IPC handles and offsets, ~100 bytes per tensor
    whatever the bucket size. All views share one storage, which the receiver opens once."""
    return serialize_named_tensors(bucket.tensors())


def serialize_named_tensors(named_tensors: list[tuple[str, torch.Tensor]]) -> str:
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(named_tensors)
    return base64.b64encode(buffer.getvalue()).decode()


@dataclass
class EngineWeightClient:
    """The weight-update endpoints of one SGLang server."""

    url: str
    tp_size: int = 1
    timeout_s: float = 600.0
    alignment: int = 16
    _staging: StagingBuffer = field(default_factory=lambda: StagingBuffer(share_memory=True))

    def staging_buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return self._staging.get(nbytes, device)

    def close(self) -> None:
        self._staging.release()

    def _post(self, path: str, payload: dict) -> dict:
        answer = post_json(f"{self.url}{path}", payload, timeout_s=self.timeout_s)
        if isinstance(answer, dict) and answer.get("success") is False:
            raise RuntimeError(f"{self.url}{path} failed: {answer.get('message')}")
        return answer

    def begin(self) -> None:
        self._post("/begin_weight_update", {})

    def send_bucket(self, bucket: WeightBucket, flush_cache: bool, weight_version: str | None) -> None:
        """Returns once the engine has loaded the bucket, so the handle may then be released."""
        # One payload per TP rank: each rank maps the same full tensors and keeps its shard. Each
        # is pickled separately: pickling takes a reference on the handle that unpickling returns.
        self._post(
            "/update_weights_from_tensor",
            {
                "serialized_named_tensors": [serialize_bucket(bucket) for _ in range(self.tp_size)],
                "load_format": LOAD_FORMAT,
                "flush_cache": flush_cache,
                "weight_version": weight_version,
            },
        )

    def end(self) -> None:
        # An empty bucket tells the engine's loader to let go of the staging buffer's mapping.
        self._post(
            "/update_weights_from_tensor",
            {"serialized_named_tensors": [serialize_named_tensors([])] * self.tp_size, "load_format": LOAD_FORMAT},
        )
        self._post("/end_weight_update", {})
