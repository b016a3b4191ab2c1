"""Weight buckets without a process group: grouping by size, the byte layout SGLang expects, and
gathering plain tensors straight into a staging buffer (views, no copies)."""

import pytest
import torch

from rlsys.weight_sync.buckets import bucket_layout, gather_bucket, group_into_buckets


def _named(*specs) -> list[tuple[str, torch.Tensor]]:
    return [(name, torch.arange(numel, dtype=dtype).to(dtype)) for name, numel, dtype in specs]


def test_buckets_are_consecutive_and_a_tensor_larger_than_a_bucket_goes_alone():
    tensors = _named(("a", 10, torch.float32), ("b", 10, torch.float32), ("big", 100, torch.float32),
                     ("c", 5, torch.float32))  # 40, 40, 400, 20 bytes
    groups = [[name for name, _ in group] for group in group_into_buckets(tensors, bucket_bytes=100)]
    assert groups == [["a", "b"], ["big"], ["c"]]
    with pytest.raises(ValueError, match="must be positive"):
        list(group_into_buckets(tensors, 0))


def test_layout_puts_wider_dtypes_first_and_aligns_every_view():
    tensors = _named(("half", 3, torch.bfloat16), ("wide", 3, torch.float32), ("byte", 5, torch.uint8))
    ordered, metas, total = bucket_layout(tensors, alignment=16)
    assert [name for name, _ in ordered] == ["wide", "half", "byte"]
    assert [(m.start, m.end) for m in metas] == [(0, 12), (16, 22), (32, 37)] and total == 37
    _, packed, total = bucket_layout(tensors, alignment=1)  # SGLang's broadcast receiver: back to back
    assert [(m.start, m.end) for m in packed] == [(0, 12), (12, 18), (18, 23)] and total == 23
    assert all(m.start % torch.tensor([], dtype=m.dtype).element_size() == 0 for m in packed)


def test_plain_tensors_are_gathered_into_the_staging_buffer_as_views():
    tensors = _named(("w", 6, torch.float32), ("b", 4, torch.bfloat16))
    tensors[0] = ("w", tensors[0][1].reshape(2, 3))
    buffer = torch.zeros(256, dtype=torch.uint8)
    bucket = gather_bucket(tensors, buffer, alignment=16)
    views = dict(bucket.tensors())
    assert torch.equal(views["w"], tensors[0][1]) and torch.equal(views["b"], tensors[1][1])
    assert all(v.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr() for v in views.values())
    with pytest.raises(ValueError, match="smaller than the bucket"):
        gather_bucket(tensors, torch.zeros(8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="needs an output buffer"):
        gather_bucket(tensors, None)
