"""The broadcast transport's host-side watch of a collective, with Work objects that behave as the
backends' own do: ProcessGroupNCCL's WorkNCCL::isSuccess() throws ("deprecated") while wait() on a
completed work returns or raises its error; gloo implements both."""

import pytest

from rlsys.weight_sync.broadcast import WeightSyncError, _Calls, wait_for_collective


class NcclLikeWork:
    """A completed NCCL collective as torch's WorkNCCL answers (ProcessGroupNCCL.cpp)."""

    def __init__(self, error: Exception | None = None):
        self.error = error
        self.waited = False

    def is_completed(self) -> bool:
        return True  # WorkNCCL::isCompleted is also true when the work recorded an exception

    def is_success(self) -> bool:
        raise NotImplementedError("WorkNCCL::isSuccess() is deprecated")

    def exception(self):
        return self.error

    def wait(self, timeout=None) -> bool:
        self.waited = True
        if self.error is not None:
            raise self.error
        return True


def test_a_completed_nccl_broadcast_is_accepted():
    work, calls = NcclLikeWork(), _Calls()
    wait_for_collective(work, calls, 5.0, "broadcast of a weight bucket", abort=lambda: None)
    assert work.waited


def test_a_failed_nccl_broadcast_raises_a_weight_sync_error_with_the_backend_error():
    work = NcclLikeWork(RuntimeError("NCCL error: remote process exited or there was a network error"))
    with pytest.raises(WeightSyncError, match="broadcast of a weight bucket failed: NCCL error: remote process"):
        wait_for_collective(work, _Calls(), 5.0, "broadcast of a weight bucket", abort=lambda: None)
