"""A checkpoint interrupted while it is written leaves the last good one in place, and the next
save clears the partial one. (A killed run resuming from its last checkpoint: tests/e2e/test_resume.py.)"""

import pytest


def test_interrupted_checkpoint_leaves_the_last_good_one(tmp_path):
    from rlsys.run.checkpointing import CheckpointStore, CoordinatorState

    store = CheckpointStore(tmp_path, keep_last=2)
    state = CoordinatorState(next_step=2, weight_version=2, data_epoch=0, data_index=64)
    store.save(2, lambda d: (open(f"{d}/trainer.bin", "w").write("ok")), state)

    def crash(directory):
        open(f"{directory}/trainer.bin", "w").write("half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        store.save(4, crash, CoordinatorState(4, 4, 0, 128))
    assert store.latest().name == "step_00000002"
    assert store.load_state(store.latest()) == state
    store.save(6, lambda d: None, CoordinatorState(6, 6, 0, 192))  # clears the partial one
    assert sorted(p.name for p in store.root.iterdir()) == ["step_00000002", "step_00000006"]
