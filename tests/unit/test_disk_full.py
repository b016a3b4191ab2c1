"""A disk that fills up under a run, on a small tmpfs and without a run: the writer that hit it removes
what it left half-written, the failure is one line naming the file system and its free space, the
status says `failed`, and the last whole checkpoint stays resumable. (A whole run on such a disk,
failing and resuming: tests/e2e/test_disk_full.py.)"""

from __future__ import annotations

import errno
import json
import pickle
import shutil
import subprocess
import sys

import pytest

from rlsys.errors import RunFailed
from rlsys.observability.status.state import RunStatus
from rlsys.run.checkpointing import CheckpointStore, CoordinatorState
from tests.helpers import fill_disk


def _no_space_error(directory) -> OSError:
    """The error a write into the full file system of `directory` really raises."""
    fill_disk(directory)
    try:
        (directory / "one-more").write_bytes(b"x" * 65536)
    except OSError as error:
        assert error.errno == errno.ENOSPC
        return error
    raise AssertionError("the disk is not full")


def _temporary_files(root) -> list[str]:
    return sorted(str(p) for p in root.rglob("*") if ".tmp" in p.name)


def test_a_checkpoint_that_fills_the_disk_leaves_nothing_and_the_last_one_stays(small_disk):
    store = CheckpointStore(small_disk / "run", keep_last=2)
    state = CoordinatorState(next_step=2, weight_version=2, data_epoch=0, data_index=64)
    store.save(2, lambda d: open(f"{d}/trainer.bin", "wb").write(b"\1" * 1_000_000), state)

    def big_trainer_state(directory):
        with open(f"{directory}/trainer.bin", "wb") as handle:
            handle.write(b"\2" * 4_000_000)  # more than the 3 MB disk holds

    with pytest.raises(OSError) as error:
        store.save(4, big_trainer_state, CoordinatorState(4, 4, 0, 128))
    assert error.value.errno == errno.ENOSPC
    assert _temporary_files(small_disk) == []  # the partial step_4 is gone, and its space with it
    assert [p.name for p in store.complete_checkpoints()] == ["step_00000002"]
    assert store.load_state(store.latest()) == state
    assert (store.latest() / "trainer.bin").read_bytes() == b"\1" * 1_000_000


def test_the_status_on_a_full_disk_still_says_failed_and_leaves_no_temporary(small_disk):
    status = RunStatus(run_id="run", total_steps=10, run_dir=str(small_disk))
    status.set_state("syncing")
    status.save_snapshot()
    fill_disk(small_disk)
    status.fail("no space left")
    status.save_snapshot()
    snapshot = json.loads((small_disk / "status.json").read_text())
    assert snapshot["state"] == "failed" and snapshot["error"] == "no space left"
    assert _temporary_files(small_disk) == []


def _failure_of(error: BaseException, run_dir) -> RunFailed:
    from rlsys.run.lifecycle import _failures_reported

    status = RunStatus(run_id="run", total_steps=10, run_dir=str(run_dir))
    status.set_state("checkpointing")
    with pytest.raises(RunFailed) as failed, _failures_reported(status):
        raise error
    snapshot = json.loads((run_dir / "status.json").read_text())
    assert snapshot["state"] == "failed" and str(failed.value).endswith(snapshot["error"])
    return failed.value


def test_a_full_disk_fails_the_run_with_one_line_naming_it_its_free_space_and_the_checkpoint(small_disk):
    """Raised in the driver (a metrics or status write), and as the trainer's checkpoint save
    raises it: DCP's CheckpointException holding each rank's OSError, in Ray's wrapper."""
    from ray.exceptions import RayTaskError
    from torch.distributed.checkpoint.api import CheckpointException

    run_dir = small_disk / "run"
    store = CheckpointStore(run_dir)
    store.save(2, lambda d: None, CoordinatorState(2, 2, 0, 64))
    disk_full = _no_space_error(small_disk)
    (small_disk / "filler").unlink()  # what the failed writers gave back
    ranks_failed = CheckpointException("ranks: [0, 1]", {0: (disk_full, None), 1: (disk_full, None)})
    # as the driver gets it: pickled in the actor, wrapped by Ray
    in_actor = RayTaskError("TrainerWorker.save_checkpoint", "Traceback ...", pickle.loads(pickle.dumps(ranks_failed)))
    for error in (disk_full, in_actor.as_instanceof_cause()):
        message = str(_failure_of(error, run_dir))
        free_mib = shutil.disk_usage(small_disk).free / 2**20
        assert message == (f"no space left on the device of {run_dir}: {free_mib:.1f} MiB free of 3.0 MiB there; "
                           f"free some space, then --resume continues from {store.path_for(2)}")


def test_other_failures_keep_their_message(tmp_path):
    from ray.exceptions import RayTaskError

    error = RayTaskError("TrainerWorker.train_step", "Traceback ...", OSError(errno.EIO, "Input/output error"))
    assert str(_failure_of(error.as_instanceof_cause(), tmp_path)) == (
        "a trainer rank or rollout engine failed: OSError: [Errno 5] Input/output error")


def test_a_full_disk_under_torch_save_is_named_as_a_full_disk(small_disk):
    """torch.save's zip writer reports a short write as a RuntimeError ("unexpected pos N vs M"),
    not an OSError; DCP's per-rank shard writes go through it. (Saved in a child process: the
    failed writer keeps its half-written file open until its process ends.)"""
    from torch.distributed.checkpoint.api import CheckpointException

    run_dir = small_disk / "run"
    run_dir.mkdir()
    save = ("import torch\ntry:\n    torch.save(torch.zeros(2**20), 'shard.distcp')\n"
            "except RuntimeError as error:\n    print(error)")
    printed = subprocess.run([sys.executable, "-c", save], cwd=small_disk, capture_output=True, text=True, check=True)
    (small_disk / "shard.distcp").unlink(missing_ok=True)  # what the failed writer gives back
    assert printed.stdout.strip(), "torch.save did not fail on a full disk"
    ranks_failed = CheckpointException("ranks: [0]", {0: (RuntimeError(printed.stdout.strip()), None)})
    message = str(_failure_of(ranks_failed, run_dir))
    assert message.startswith(f"no space left on the device of {run_dir}: ")
    assert message.endswith("free some space, no checkpoint was written yet")
