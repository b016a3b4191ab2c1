"""Weight sync without engines: the broadcast transport's host-side watch of a collective, on a real
gloo group whose other member (a short Python process) joined and stays silent, as a frozen engine
does. (Weight sync into real SGLang servers: tests/e2e/test_weight_sync.py.)"""

import pytest

_SILENT_PEER = """
import sys, time
from datetime import timedelta
from rlsys.weight_sync.broadcast import new_custom_process_group
group = new_custom_process_group("gloo", "127.0.0.1", int(sys.argv[1]), 1, 2, sys.argv[2], timedelta(seconds=120))
time.sleep(180)  # joined, and never takes part in a collective: a frozen engine
"""


@pytest.fixture
def group_with_silent_peer():
    import subprocess
    import sys
    from datetime import timedelta

    from rlsys.system.rendezvous import ReservedPort
    from rlsys.weight_sync.broadcast import new_custom_process_group

    # The store waits up to 120 s for the peer to join: a loaded machine took 3.9-5+ s to start it (importing
    # torch). The timeout under test is the host-side watch's 2 s, not the group's.
    reserved = ReservedPort("127.0.0.1")
    port = reserved.port
    name = f"silent-{port}"
    peer = subprocess.Popen([sys.executable, "-c", _SILENT_PEER, str(port), name])
    try:
        yield new_custom_process_group("gloo", "127.0.0.1", port, 0, 2, name, timedelta(seconds=120), reserved)
    finally:
        peer.kill()
        peer.wait()


@pytest.mark.parametrize("engine_call_fails", [False, True])
def test_a_broadcast_nobody_receives_fails_on_the_host_within_the_timeout(group_with_silent_peer, engine_call_fails):
    """The host-side watch of a collective (NCCL's work.wait never times out on the host): a
    silent peer gives a timeout naming the engine still unanswered; a failed engine call ends the
    wait at once, naming it. Both abort the group."""
    import threading
    import time

    import torch
    import torch.distributed as dist

    from rlsys.weight_sync.broadcast import WeightSyncError, WeightSyncTimeout, _Calls, wait_for_collective

    calls, answered = _Calls(), threading.Event()

    def engine_call():
        if engine_call_fails:
            raise RuntimeError("engine-3 refused the bucket")
        answered.wait(30)  # an engine waiting in the broadcast

    calls.start("engine-3", engine_call)
    aborted = []
    buffer = torch.zeros(64 * 2**20, dtype=torch.uint8)  # more than the sockets buffer: the send blocks
    work = dist.broadcast(buffer, src=0, group=group_with_silent_peer, async_op=True)
    start = time.monotonic()
    expected = (WeightSyncError, "engine-3.*refused") if engine_call_fails else (WeightSyncTimeout, r"within 2s.*engine-3")
    with pytest.raises(expected[0], match=expected[1]):
        wait_for_collective(work, calls, 2.0, "broadcast of a weight bucket", lambda: aborted.append(True))
    answered.set()
    assert aborted == [True]
    assert time.monotonic() - start < (1.0 if engine_call_fails else 3.0)
