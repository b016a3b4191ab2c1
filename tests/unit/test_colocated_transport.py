"""The colocated transport's GPU decisions, checked on CPU: what a failed sync shares, and when the
engine's loader waits for its device copies.

The GPU calls themselves (torch's `_share_cuda_`, a stream's synchronize) stand in as fakes here;
the decisions around them are real.
"""

from __future__ import annotations

import base64
import os
import pickle
from types import SimpleNamespace

import pytest
import torch

from rlsys.system.backend import make_backend
from rlsys.weight_sync import colocated
from rlsys.weight_sync.colocated import ColocatedWeightSender
from rlsys.weight_sync.engine_loader import END_OF_SYNC, load_bucket
from rlsys.weight_sync.sync import sync_weights

# ---------------------------------------------------------------- (a) a failed sync shares nothing it never handed over


class _OpeningEngine:
    """The transport's endpoints, opening each payload as SGLang does (unpickling returns the
    reference its pickle took on the buffer), then dropping it; refuses one call if told to."""

    def __init__(self, fail: str | None = None):
        self.fail = fail  # "begin" or "update": that call (the first update) fails
        self.calls: list[str] = []

    def begin_weight_update(self) -> None:
        self.calls.append("begin")
        if self.fail == "begin":
            raise RuntimeError("engine refused to begin")

    def update_weights_from_tensor(self, serialized_named_tensors, load_format, flush_cache=False,
                                   weight_version=None) -> None:
        opened = [pickle.loads(base64.b64decode(payload)) for payload in serialized_named_tensors]
        self.calls.append("update")
        del opened
        if self.fail == "update" and self.calls.count("update") == 1:
            raise RuntimeError("engine refused the bucket")

    def end_weight_update(self) -> None:
        self.calls.append("end")


def _shm_path(tensor: torch.Tensor) -> str:
    """The /dev/shm file behind a shared-memory tensor (file_system strategy)."""
    _manager, name, _size = tensor.untyped_storage()._share_filename_cpu_()
    return os.path.join("/dev/shm", name.decode().lstrip("/"))


@pytest.mark.parametrize("fail, handed_over", [("begin", []), ("update", [["w0"], []])])
def test_a_failed_sync_pickles_no_bucket_queued_behind_the_failure_and_frees_its_buffers(monkeypatch, fail,
                                                                                       handed_over):
    backend = make_backend(False)
    backend.prepare_ipc()
    pickled: list[list[str]] = []
    real = colocated.serialize_named_tensors

    def counting(named_tensors):
        pickled.append([name for name, _ in named_tensors])
        return real(named_tensors)

    monkeypatch.setattr(colocated, "serialize_named_tensors", counting)
    engine = _OpeningEngine(fail=fail)
    sender = ColocatedWeightSender(engine)
    params = [(f"w{i}", torch.full((4, 4), float(i))) for i in range(3)]  # 64 bytes: one bucket each
    # Pipelined: buckets 0 and 1 are queued (slots 0 and 1) before the sync waits on bucket 0.
    with pytest.raises(RuntimeError, match="refused"):
        sync_weights(params, 64, sender, "1", backend)
    # Only what the engine was really handed is pickled: after a refused begin nothing; after a
    # refused bucket 0, bucket 0 and the empty bucket that makes the loader let go of the buffers.
    assert pickled == handed_over
    assert engine.calls[-1] == "end"
    files = [_shm_path(sender.staging_buffer(slot, 1, torch.device("cpu"))) for slot in (0, 1)]
    assert all(os.path.exists(path) for path in files)
    sender.release_staging_buffer()
    # Every pickle was opened (its reference returned) and nothing holds the buffers any more:
    # their shared-memory files are gone (on GPU: the blocks are freed, or ipc_collect can free them).
    assert not any(os.path.exists(path) for path in files)
    sender.close()


def test_a_bucket_handed_over_after_a_good_sync_is_pickled_once_per_tp_rank(monkeypatch):
    backend = make_backend(False)
    backend.prepare_ipc()
    pickled: list[list[str]] = []
    real = colocated.serialize_named_tensors
    monkeypatch.setattr(colocated, "serialize_named_tensors",
                        lambda named: pickled.append([n for n, _ in named]) or real(named))
    engine = _OpeningEngine()
    sender = ColocatedWeightSender(engine, tp_size=2)
    params = [(f"w{i}", torch.full((4, 4), float(i))) for i in range(2)]
    sync_weights(params, 64, sender, "1", backend)
    assert pickled == [["w0"], ["w0"], ["w1", END_OF_SYNC], ["w1", END_OF_SYNC]]
    files = [_shm_path(sender.staging_buffer(slot, 1, torch.device("cpu"))) for slot in (0, 1)]
    sender.release_staging_buffer()
    assert not any(os.path.exists(path) for path in files)
    sender.close()


# ---------------------------------------------------------------- (b) the loader waits for its device copies


class _FakeCudaTensor:
    """What `load_bucket` reads of a tensor: its device (a CUDA one, on a machine without a GPU)."""

    def __init__(self, index: int):
        self.device = torch.device("cuda", index)


class _RecordingModel(torch.nn.Module):
    def __init__(self, events: list, fail: bool = False):
        super().__init__()
        self.events = events
        self.fail = fail

    def load_weights(self, named_tensors):
        self.events.append(("load", [name for name, _ in named_tensors]))
        if self.fail:
            raise RuntimeError("shape mismatch")


@pytest.fixture
def stream_syncs(monkeypatch) -> list:
    """Records `torch.cuda.current_stream(device).synchronize()` calls in the shared event list."""
    events: list = []

    def current_stream(device=None):
        return SimpleNamespace(synchronize=lambda: events.append(("synchronize", torch.device(device))))

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    return events


def test_the_engine_loader_waits_for_its_device_copies_before_it_returns(stream_syncs):
    events = stream_syncs
    staging = _FakeCudaTensor(1)
    load_bucket(_RecordingModel(events), [("a", staging), ("b", staging), (END_OF_SYNC, staging)])
    # the copies are queued first, then this thread's stream on their device is waited for
    assert events == [("load", ["a", "b"]), ("synchronize", torch.device("cuda", 1))]


def test_the_engine_loader_waits_for_its_device_copies_even_when_the_load_fails(stream_syncs):
    events = stream_syncs
    with pytest.raises(RuntimeError, match="shape mismatch"):
        load_bucket(_RecordingModel(events, fail=True), [("a", _FakeCudaTensor(0))])
    assert events == [("load", ["a"]), ("synchronize", torch.device("cuda", 0))]


def test_the_engine_loader_does_not_touch_cuda_for_host_tensors(stream_syncs):
    events = stream_syncs
    staging = torch.zeros(8)
    load_bucket(_RecordingModel(events), [("a", staging[:4]), (END_OF_SYNC, staging[:0])])
    load_bucket(_RecordingModel(events), [])  # an empty bucket (a failed sync's last) loads nothing
    assert events == [("load", ["a"])]
