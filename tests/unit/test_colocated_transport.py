"""The colocated transport's GPU decisions, checked on CPU: what a failed sync shares, when the
engine's loader waits for its device copies, and how a CUDA payload names its device.

The GPU calls themselves (torch's `_share_cuda_`, a stream's synchronize, a device's UUID) stand in
as fakes here; the decisions around them, and the wire format SGLang's receiver reads, are real.
"""

from __future__ import annotations

import base64
import inspect
import io
import os
import pickle
import uuid
from types import SimpleNamespace

import pytest
import torch
from torch.multiprocessing import reductions

from rlsys.system.backend import make_backend
from rlsys.weight_sync import colocated
from rlsys.weight_sync.colocated import DEVICE_ARG_INDEX, ColocatedWeightSender, serialize_named_tensors, with_device_uuid
from rlsys.weight_sync.engine_loader import END_OF_SYNC, load_bucket, restart_random_streams, seed_entry
from rlsys.weight_sync.sync import SyncPlan, sync_weights

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
        sync_weights(params, SyncPlan(64, "1"), sender, backend)
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
    sync_weights(params, SyncPlan(64, "1"), sender, backend)
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


def test_the_seed_load_format_restarts_the_engines_random_streams_and_loads_nothing(stream_syncs):
    """The request an attached run sends after its first push (RolloutEngine.restart_random_stream):
    through the payload a server on another node gets (an empty tensor, no shared memory), its load
    format's function restarts torch's (and Python's) streams where `--random-seed` starts them and
    loads no weight."""
    import random

    events = stream_syncs
    payload = serialize_named_tensors([seed_entry(1234)])
    opened = pickle.loads(base64.b64decode(payload))
    torch.manual_seed(99), random.seed(99)  # a stream earlier runs moved on
    restart_random_streams(_RecordingModel(events), opened)
    drawn = (torch.rand(3), random.random())
    torch.manual_seed(1234), random.seed(1234)
    assert torch.equal(drawn[0], torch.rand(3)) and drawn[1] == random.random()
    assert events == []


# ---------------------------------------------------------------- (c) a CUDA payload names its device by UUID

# Two GPUs as the trainer and the engine each see them: the trainer's CUDA_VISIBLE_DEVICES shows only
# physical GPU 1 (its cuda:0); the engine's shows both (physical GPU 1 is its cuda:1).
_GPU0, _GPU1 = uuid.UUID(int=0xA0), uuid.UUID(int=0xB1)


def _see_gpus(monkeypatch, uuids: list[uuid.UUID]) -> None:
    """The CUDA queries a device's UUID comes from, as a process with these visible GPUs answers them."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(uuids))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(uuid=uuids[index]))


def _cuda_reduction(device_index: int):
    """A tuple shaped like `reduce_tensor`'s output for a CUDA tensor (`storage._share_cuda_()`'s
    fields: device, IPC handle, storage bytes and offset, ref counter handle and offset, event)."""
    return (reductions.rebuild_cuda_tensor,
            (torch.Tensor, torch.Size([4]), (1,), 0, torch.storage.TypedStorage, torch.float32,
             device_index, b"\x01" * 64, 16, 0, False, b"/torch_1_2", 3, b"\x02" * 64, True))


def test_the_device_slot_is_rebuild_cuda_tensors_device_argument_as_in_sglang():
    from sglang.srt.utils.patch_torch import _REDUCE_TENSOR_ARG_DEVICE_INDEX

    parameters = list(inspect.signature(reductions.rebuild_cuda_tensor).parameters)
    assert parameters[DEVICE_ARG_INDEX] == "storage_device"
    assert DEVICE_ARG_INDEX == _REDUCE_TENSOR_ARG_DEVICE_INDEX


def test_with_device_uuid_replaces_only_the_device_index_by_the_gpus_uuid():
    rebuild, args = _cuda_reduction(0)
    new_rebuild, new_args = with_device_uuid((rebuild, args), device_uuid={0: "gpu-b"}.__getitem__)
    assert new_rebuild is reductions.rebuild_cuda_tensor  # torch's own: SGLang's unpickler admits no other
    assert new_args[DEVICE_ARG_INDEX] == "gpu-b"
    assert new_args[:DEVICE_ARG_INDEX] == args[:DEVICE_ARG_INDEX]
    assert new_args[DEVICE_ARG_INDEX + 1:] == args[DEVICE_ARG_INDEX + 1:]
    # already a UUID (a process where SGLang patched torch's reductions): left as it is
    assert with_device_uuid((new_rebuild, new_args), device_uuid=None) == (new_rebuild, new_args)
    with pytest.raises(TypeError, match="DEVICE_ARG_INDEX"):  # torch moved the device: say so, do not guess
        with_device_uuid((rebuild, (*args[:DEVICE_ARG_INDEX], b"x", *args[DEVICE_ARG_INDEX + 1:])))


def test_sglangs_receiver_maps_the_uuid_to_its_own_index_of_the_trainers_gpu(monkeypatch):
    from sglang.srt.utils.patch_torch import _device_from_maybe_uuid

    _see_gpus(monkeypatch, [_GPU1])  # the trainer
    _, args = with_device_uuid(_cuda_reduction(0))  # the real lookup: str(get_device_properties(0).uuid)
    assert args[DEVICE_ARG_INDEX] == str(_GPU1)
    _see_gpus(monkeypatch, [_GPU0, _GPU1])  # the engine
    assert _device_from_maybe_uuid(args[DEVICE_ARG_INDEX]) == 1


class _LooksLikeCuda(torch.Tensor):
    """A host tensor the serializer takes for a CUDA one (torch's CUDA reduction is faked below)."""

    @property
    def is_cuda(self) -> bool:
        return True


def test_a_cuda_payload_opens_in_sglangs_unpickler_on_the_engines_index_of_the_gpu(monkeypatch):
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import _rebuild_cuda_tensor_modified

    _see_gpus(monkeypatch, [_GPU1])  # the trainer
    fake = torch.zeros(4).as_subclass(_LooksLikeCuda)
    # torch's reduce_tensor as it answers for a CUDA tensor (needs a GPU: `storage._share_cuda_()`)
    monkeypatch.setattr(reductions, "reduce_tensor", lambda tensor: _cuda_reduction(0))
    payload = serialize_named_tensors([("w", fake)])
    # The engine: SGLang's monkey_patch_torch_reductions swaps torch's rebuild_cuda_tensor for its own,
    # which maps the device slot and calls the original (here: records what it would rebuild on).
    _see_gpus(monkeypatch, [_GPU0, _GPU1])
    rebuilt_on: list = []
    monkeypatch.setattr(reductions, "_rebuild_cuda_tensor_original",
                        lambda *args: rebuilt_on.append(args[DEVICE_ARG_INDEX]) or "mapped", raising=False)
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", _rebuild_cuda_tensor_modified)
    assert MultiprocessingSerializer.deserialize(payload) == [("w", "mapped")]  # SafeUnpickler admits it
    assert rebuilt_on == [1]


def test_a_host_payload_is_torchs_own_and_opens_in_sglangs_unpickler():
    from sglang.srt.utils.common import MultiprocessingSerializer

    make_backend(False).prepare_ipc()
    staging = torch.arange(8, dtype=torch.float32).share_memory_()
    payload = serialize_named_tensors([("a", staging[:4]), ("b", staging[4:])])
    # the pickler leaves host tensors to torch's reductions (registered with ForkingPickler)
    assert colocated._EnginePickler(io.BytesIO()).reducer_override(staging) is NotImplemented
    opened = MultiprocessingSerializer.deserialize(payload)
    assert [name for name, _ in opened] == ["a", "b"]
    assert torch.equal(opened[0][1], staging[:4]) and torch.equal(opened[1][1], staging[4:])
