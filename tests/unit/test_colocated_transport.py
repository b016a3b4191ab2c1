"""The colocated transport's GPU decisions, checked on CPU: when the engine's loader waits for its
device copies.

The GPU call itself (a stream's synchronize) stands in as a fake here; the decision around it is real.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlsys.weight_sync.engine_loader import END_OF_SYNC, load_bucket

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
