"""Where a trainer rank wraps the model in FSDP2: only where it has work (sharding over ranks, casting
to the compute dtype, streaming a frozen reference). (2 FSDP2 ranks training exactly like one
rank: tests/e2e/test_fsdp_equivalence.py.)"""

from rlsys.actors.parallelize import uses_fsdp


def test_fsdp_wraps_the_model_only_where_it_has_work():
    assert uses_fsdp(world_size=2, dtype="float32", trainable=True)  # shards
    assert uses_fsdp(world_size=1, dtype="bfloat16", trainable=True)  # casts to the compute dtype
    assert uses_fsdp(world_size=1, dtype="float32", trainable=False)  # streams the frozen reference
    assert not uses_fsdp(world_size=1, dtype="float32", trainable=True)  # would only copy
