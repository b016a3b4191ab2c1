"""Weight-sync buckets on plain (non-DTensor) CPU tensors: size-bounded grouping, the byte layout
(widest dtype first, aligned views) and gathering into one staging buffer without a copy."""

from __future__ import annotations

import time

import pytest
import torch

from rlsys.weight_sync.buckets import TensorMeta, bucket_layout, gather_bucket, group_into_buckets
from rlsys.weight_sync.engine_loader import END_OF_SYNC


def _f32(numel: int) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.float32)


def _names(groups) -> list[list[str]]:
    return [[name for name, _ in group] for group in groups]


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bytes, for bit-for-bit comparison (NaN payloads and -0.0 included)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


# ---------------------------------------------------------------- group_into_buckets


def test_groups_are_consecutive_and_stay_within_the_bucket_size():
    # 16 + 8 + 4 = 28 bytes fit exactly; 40 bytes is over budget and goes alone; 8 starts a new group
    tensors = [("a", _f32(4)), ("b", _f32(2)), ("c", _f32(1)), ("d", _f32(10)), ("e", _f32(2))]
    groups = list(group_into_buckets(tensors, bucket_bytes=28))
    assert _names(groups) == [["a", "b", "c"], ["d"], ["e"]]


def test_groups_hold_the_original_tensors():
    tensors = [("a", _f32(4)), ("b", _f32(2))]
    groups = list(group_into_buckets(tensors, bucket_bytes=1024))
    assert len(groups) == 1
    assert all(got is want for (_, got), (_, want) in zip(groups[0], tensors, strict=True))


def test_a_tensor_larger_than_the_bucket_goes_alone_even_first():
    tensors = [("big", _f32(100)), ("x", _f32(1)), ("y", _f32(1)), ("big2", _f32(50)), ("z", _f32(1))]
    assert _names(group_into_buckets(tensors, bucket_bytes=8)) == [["big"], ["x", "y"], ["big2"], ["z"]]


def test_group_sizes_count_each_dtypes_element_size():
    tensors = [("h", torch.zeros(4, dtype=torch.float16)), ("b", torch.zeros(4, dtype=torch.int8)),
               ("d", torch.zeros(1, dtype=torch.float64)), ("bf", torch.zeros(2, dtype=torch.bfloat16))]
    # 8 + 4 = 12 fit; 12 + 8 > 16; 8 + 4 = 12 fit
    assert _names(group_into_buckets(tensors, bucket_bytes=16)) == [["h", "b"], ["d", "bf"]]


def test_no_tensors_give_no_groups():
    assert list(group_into_buckets([], bucket_bytes=16)) == []


@pytest.mark.parametrize("bucket_bytes", [0, -1])
def test_a_non_positive_bucket_size_is_rejected(bucket_bytes):
    with pytest.raises(ValueError, match="bucket size must be positive"):
        list(group_into_buckets([("a", _f32(1))], bucket_bytes))


# ---------------------------------------------------------------- bucket_layout


def _mixed() -> list[tuple[str, torch.Tensor]]:
    return [
        ("h", torch.tensor([1.5, -0.0, float("nan")], dtype=torch.float16)),  # 6 bytes
        ("b", torch.tensor([1, -2, 3, -4, 5], dtype=torch.int8)),  # 5 bytes
        ("f", torch.tensor([[1.0, float("inf"), -0.0], [float("nan"), 2.5, -3.0]], dtype=torch.float32)),  # 24
        ("d", torch.tensor([3.141592653589793], dtype=torch.float64)),  # 8 bytes
        ("g", torch.tensor([0.5, -7.0], dtype=torch.bfloat16)),  # 4 bytes
    ]


def test_layout_puts_the_widest_dtype_first_keeping_input_order_among_equals():
    ordered, metas, _ = bucket_layout(_mixed())
    assert [name for name, _ in ordered] == ["d", "f", "h", "g", "b"]
    assert [m.name for m in metas] == ["d", "f", "h", "g", "b"]
    by_name = dict(_mixed())
    for meta in metas:
        assert meta.shape == by_name[meta.name].shape and meta.dtype == by_name[meta.name].dtype


def test_layout_with_alignment_16_starts_every_tensor_on_a_16_byte_boundary():
    _, metas, total = bucket_layout(_mixed(), alignment=16)
    assert [(m.name, m.start, m.end) for m in metas] == [
        ("d", 0, 8), ("f", 16, 40), ("h", 48, 54), ("g", 64, 68), ("b", 80, 85)]
    assert total == 85


def test_layout_with_alignment_1_has_no_padding_and_views_stay_aligned():
    _, metas, total = bucket_layout(_mixed(), alignment=1)
    assert [(m.name, m.start, m.end) for m in metas] == [
        ("d", 0, 8), ("f", 8, 32), ("h", 32, 38), ("g", 38, 42), ("b", 42, 47)]
    assert total == 47
    for meta in metas:
        assert meta.start % meta.dtype.itemsize == 0, meta


def test_layout_alignment_1_keeps_views_aligned_with_odd_element_counts():
    tensors = [("b", torch.zeros(3, dtype=torch.int8)), ("h", torch.zeros(3, dtype=torch.float16)),
               ("f", torch.zeros(3, dtype=torch.float32)), ("d", torch.zeros(3, dtype=torch.float64))]
    _, metas, total = bucket_layout(tensors, alignment=1)
    assert [(m.name, m.start, m.end) for m in metas] == [("d", 0, 24), ("f", 24, 36), ("h", 36, 42), ("b", 42, 45)]
    assert total == 45
    assert all(m.start % m.dtype.itemsize == 0 for m in metas)


def test_layout_total_is_the_end_of_the_last_tensor():
    _, metas, total = bucket_layout([("a", _f32(3))], alignment=16)
    assert metas == [TensorMeta("a", torch.Size([3]), torch.float32, 0, 12)]
    assert total == 12  # no trailing padding


def test_layout_of_nothing_is_empty():
    assert bucket_layout([]) == ([], [], 0)


# ---------------------------------------------------------------- gather_bucket


def test_gathered_views_equal_the_inputs_bit_for_bit():
    tensors = _mixed()
    buffer = torch.zeros(100, dtype=torch.uint8)
    bucket = gather_bucket(tensors, buffer)
    views = dict(bucket.tensors())
    assert list(views) == ["d", "f", "h", "g", "b"]
    for name, tensor in tensors:
        view = views[name]
        assert view.dtype == tensor.dtype and view.shape == tensor.shape, name
        assert torch.equal(_bytes(view), _bytes(tensor)), name


def test_gathered_views_share_the_buffers_storage():
    buffer = torch.zeros(100, dtype=torch.uint8)
    bucket = gather_bucket(_mixed(), buffer)
    assert bucket.buffer.numel() == 85
    assert bucket.buffer.data_ptr() == buffer.data_ptr()
    storage = buffer.untyped_storage().data_ptr()
    metas = {m.name: m for m in bucket.metas}
    for name, view in bucket.tensors():
        assert view.untyped_storage().data_ptr() == storage, name
        assert view.data_ptr() == buffer.data_ptr() + metas[name].start, name
    # a write through the buffer shows in the view: no copy was made
    buffer[80] = 42  # first byte of "b" (int8)
    assert dict(bucket.tensors())["b"][0].item() == 42


def test_gathering_leaves_the_inputs_unchanged_and_copies_non_contiguous_ones():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    transposed = base.t()  # non-contiguous view
    tensors = [("t", transposed), ("s", torch.tensor(7.0))]  # a 0-dim scalar too
    before = transposed.clone()
    buffer = torch.zeros(64, dtype=torch.uint8)
    bucket = gather_bucket(tensors, buffer, alignment=16)
    views = dict(bucket.tensors())
    assert views["t"].shape == (4, 3) and torch.equal(views["t"], before)
    assert views["s"].shape == () and views["s"].item() == 7.0
    assert torch.equal(transposed, before)
    views["t"].fill_(0)  # the views do not alias the inputs
    assert torch.equal(transposed, before)


def test_gathering_with_alignment_1_packs_the_buffer_tightly():
    buffer = torch.zeros(47, dtype=torch.uint8)  # exactly the bucket's size
    bucket = gather_bucket(_mixed(), buffer, alignment=1)
    assert bucket.buffer.numel() == 47
    views = dict(bucket.tensors())
    for name, tensor in _mixed():
        assert torch.equal(_bytes(views[name]), _bytes(tensor)), name


def test_a_buffer_smaller_than_the_bucket_is_rejected():
    with pytest.raises(ValueError, match=r"84 bytes is smaller than the bucket \(85\)"):
        gather_bucket(_mixed(), torch.zeros(84, dtype=torch.uint8))


def test_an_all_gather_without_a_buffer_is_rejected():
    with pytest.raises(ValueError, match="needs an output buffer"):
        gather_bucket(_mixed(), None, dst=None)


# ---------------------------------------------------------------- the engine's dtype on the wire


def test_fp32_weights_travel_in_the_engine_dtype_at_half_the_bytes():
    tensors = [("w", torch.randn(4, 3)), ("b", torch.randn(5)), ("steps", torch.tensor([7, 9]))]
    _, fp32_metas, fp32_total = bucket_layout(tensors, alignment=1)
    _, metas, total = bucket_layout(tensors, alignment=1, engine_dtype=torch.bfloat16)
    assert {m.name: m.dtype for m in metas} == {"w": torch.bfloat16, "b": torch.bfloat16, "steps": torch.int64}
    assert total == 17 * 2 + 2 * 8 and fp32_total == 17 * 4 + 2 * 8  # integers keep their dtype
    bucket = gather_bucket(tensors, torch.empty(total, dtype=torch.uint8), alignment=1,
                           engine_dtype=torch.bfloat16)
    views = dict(bucket.tensors())
    assert torch.equal(views["w"], tensors[0][1].to(torch.bfloat16))
    assert torch.equal(views["steps"], tensors[2][1])
    assert [g for g in group_into_buckets(tensors, bucket_bytes=24, engine_dtype=torch.bfloat16)] == \
        [tensors[:1], tensors[1:2], tensors[2:]]  # bucket sizes count wire bytes (24, 10, 16)


def test_the_engine_loader_lets_go_of_the_staging_buffer_after_the_last_bucket():
    from rlsys.weight_sync.engine_loader import _KEPT_STORAGE_ATTR, END_OF_SYNC, load_bucket

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.loaded: list[list[str]] = []

        def load_weights(self, named_tensors):
            self.loaded.append([name for name, _ in named_tensors])

    staging = torch.zeros(16)
    model = Model()
    load_bucket(model, [("a", staging[:8]), ("b", staging[8:])])
    assert getattr(model, _KEPT_STORAGE_ATTR) is not None  # mapped between the buckets of a sync
    load_bucket(model, [("c", staging[:4]), (END_OF_SYNC, staging[:0])])
    assert model.loaded == [["a", "b"], ["c"]]  # the marker is not a weight
    assert getattr(model, _KEPT_STORAGE_ATTR) is None
    load_bucket(model, [("d", staging[:4])])
    load_bucket(model, [])  # a sync that failed before its last bucket ends with an empty one
    assert getattr(model, _KEPT_STORAGE_ATTR) is None and model.loaded[-1] == ["d"]


class _RecordingEngine:
    """The colocated transport's endpoints, recording what each request carried."""

    def __init__(self, fail_on_update: int | None = None):
        self.calls: list[tuple[str, list[str], bool]] = []
        self.fail_on_update = fail_on_update

    def begin_weight_update(self) -> None:
        self.calls.append(("begin", [], False))

    def update_weights_from_tensor(self, serialized_named_tensors, load_format, flush_cache=False,
                                   weight_version=None) -> None:
        import base64
        import pickle

        names = [name for name, _ in pickle.loads(base64.b64decode(serialized_named_tensors[0]))]
        self.calls.append(("update", names, flush_cache))
        if self.fail_on_update is not None and len([c for c in self.calls if c[0] == "update"]) == self.fail_on_update:
            raise RuntimeError("engine refused the bucket")

    def end_weight_update(self) -> None:
        self.calls.append(("end", [], False))


def _sync(engine, bucket_bytes: int):
    from rlsys.system.backend import make_backend
    from rlsys.weight_sync.colocated import ColocatedWeightSender
    from rlsys.weight_sync.sync import SyncPlan, sync_weights

    params = [(f"w{i}", torch.full((4, 4), float(i))) for i in range(3)]  # 64 bytes each
    return sync_weights(params, SyncPlan(bucket_bytes, "7"), ColocatedWeightSender(engine), make_backend(False))


def test_a_colocated_sync_is_begin_one_request_per_bucket_and_end():
    from rlsys.weight_sync.engine_loader import END_OF_SYNC

    engine = _RecordingEngine()
    _sync(engine, bucket_bytes=128)  # two buckets: w0+w1, w2
    assert engine.calls == [("begin", [], False), ("update", ["w0", "w1"], False),
                            ("update", ["w2", END_OF_SYNC], True), ("end", [], False)]


def test_a_sync_that_fails_mid_way_still_releases_the_engines_mapping():
    engine = _RecordingEngine(fail_on_update=1)
    with pytest.raises(RuntimeError, match="refused"):
        _sync(engine, bucket_bytes=128)
    # The second bucket is not sent; an empty bucket tells the loader to let go, then the session ends.
    assert [(kind, names) for kind, names, _ in engine.calls] == [("begin", []), ("update", ["w0", "w1"]),
                                                                  ("update", []), ("end", [])]


def test_the_staging_buffers_hold_the_largest_tensor_whatever_the_bucket_size():
    from rlsys.weight_sync.sync import staging_buffer_bytes, staging_slot_bytes

    with torch.device("meta"):  # Qwen2.5-7B's shapes: what the memory plan reads, without the bytes
        params = [("embed_tokens.weight", torch.empty(152064, 3584)), ("q_proj.weight", torch.empty(3584, 3584)),
                  ("norm.weight", torch.empty(3584)), ("lm_head.weight", torch.empty(152064, 3584))]
    lm_head = 152064 * 3584 * 2  # bytes in bf16: ~1 GiB, twice the 512 MiB bucket
    serial = dict(pipelined=False)
    assert staging_buffer_bytes(params, 512 * 2**20, engine_dtype=torch.bfloat16, **serial) == lm_head + 16
    assert staging_buffer_bytes(params, 512 * 2**20, alignment=1, **serial) == 2 * lm_head + 1  # fp32 on the wire
    small = [(f"w{i}", torch.empty(4, 4)) for i in range(3)]
    assert staging_buffer_bytes(small, bucket_bytes=128, **serial) == 2 * (64 + 16)  # two tensors share bucket 0
    # Pipelined, buckets alternate between two slots: [embed], [q_proj, norm], [lm_head] -> slot 0
    # holds the larger of embed and lm_head, slot 1 the attention bucket.
    middle = 3584 * 3584 * 2 + 16 + 3584 * 2 + 16
    assert staging_slot_bytes(params, 512 * 2**20, engine_dtype=torch.bfloat16) == [lm_head + 16, middle]
    assert staging_buffer_bytes(small, bucket_bytes=128) == 2 * (64 + 16) + (64 + 16)
    assert staging_slot_bytes(small, bucket_bytes=1024) == [3 * (64 + 16)]  # one bucket: one buffer


def test_a_sync_allocates_the_staging_buffers_their_size_function_plans():
    from rlsys.system.backend import make_backend
    from rlsys.weight_sync.colocated import ColocatedWeightSender
    from rlsys.weight_sync.sync import SyncPlan, staging_buffer_bytes, sync_weights

    params = [("small", torch.ones(3)), ("large", torch.ones(40, 5)), ("steps", torch.ones(2, dtype=torch.int64))]
    # buckets [small], [large], [steps]: 6, 400 and 16 bytes plus 16 of padding each
    for pipelined, expected in [(False, 400 + 16), (True, (400 + 16) + (16 + 16))]:
        sender = ColocatedWeightSender(_RecordingEngine())
        sync_weights(params, SyncPlan(64, "1", engine_dtype=torch.bfloat16, pipelined=pipelined), sender,
                     make_backend(False))
        assert sender.staging_nbytes == expected == staging_buffer_bytes(params, 64, engine_dtype=torch.bfloat16,
                                                                         pipelined=pipelined)
        sender.release_staging_buffer()
        assert sender.staging_nbytes == 0
        sender.close()


class _SlowLoadingEngine(_RecordingEngine):
    """Loads a bucket the way the engine's loader does (maps the handles, reads the tensors) and
    takes its time doing it; records when each load ran and what it read at its end."""

    def __init__(self, load_s: float, fail_on_update: int | None = None):
        super().__init__(fail_on_update)
        self.load_s = load_s
        self.loads: list[tuple[float, float, dict[str, torch.Tensor]]] = []

    def update_weights_from_tensor(self, serialized_named_tensors, load_format, flush_cache=False,
                                   weight_version=None) -> None:
        import base64
        import pickle

        start = time.perf_counter()
        mapped = pickle.loads(base64.b64decode(serialized_named_tensors[0]))
        time.sleep(self.load_s)  # the trainer gathers the next bucket meanwhile, into the other buffer
        read = {name: tensor.clone() for name, tensor in mapped if name != END_OF_SYNC}
        self.loads.append((start, time.perf_counter(), read))
        super().update_weights_from_tensor(serialized_named_tensors, load_format, flush_cache, weight_version)


def test_the_next_bucket_is_gathered_while_the_engine_loads_and_no_buffer_is_overwritten_while_read():
    from rlsys.system.backend import make_backend
    from rlsys.weight_sync.colocated import ColocatedWeightSender
    from rlsys.weight_sync.sync import SyncPlan, sync_weights

    params = [(f"w{i}", torch.full((4, 4), float(i))) for i in range(6)]  # 64 bytes each: one bucket each
    gathered_at: dict[str, float] = {}

    def materialize(name, tensor):  # called as each bucket is gathered
        gathered_at[name] = time.perf_counter()
        return tensor

    engine = _SlowLoadingEngine(load_s=0.2)
    sender = ColocatedWeightSender(engine)
    stats = sync_weights(params, SyncPlan(64, "3"), sender, make_backend(False), materialize=materialize)
    sender.close()
    assert [names for kind, names, _ in engine.calls if kind == "update"] == (
        [[f"w{i}"] for i in range(5)] + [["w5", END_OF_SYNC]])
    for index, (_start, end, read) in enumerate(engine.loads):
        assert torch.equal(read[f"w{index}"], params[index][1])  # what the engine read at the end of its load
        if index + 1 < len(params):
            assert gathered_at[f"w{index + 1}"] < end  # the next bucket was gathered during this load
        if index + 2 < len(params):
            assert gathered_at[f"w{index + 2}"] > end  # this buffer was gathered into only after it
    assert stats.buckets == 6 and stats.bytes == 6 * 64 and stats.pipelined
    # the loads, not the gathers, set the pace: the engine waits are most of the sync
    assert stats.engine_wait_s > 0.5 * 6 * 0.2


def test_a_failed_bucket_stops_the_hand_overs_queued_behind_it_and_the_session_still_ends():
    engine = _SlowLoadingEngine(load_s=0.0, fail_on_update=2)
    with pytest.raises(RuntimeError, match="refused"):
        _sync(engine, bucket_bytes=64)  # three buckets, the second refused
    assert [(kind, names) for kind, names, _ in engine.calls] == [
        ("begin", []), ("update", ["w0"]), ("update", ["w1"]), ("update", []), ("end", [])]
