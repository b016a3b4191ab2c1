"""A group's store is served on a port no other process can take between choosing it and serving it
(rlsys/system/rendezvous.py), and SGLang's side, a `tcp://` rendezvous client, still joins it."""

import errno
import socket
import subprocess
import sys
from datetime import timedelta

import pytest
import torch

from rlsys.system.rendezvous import ReservedPort, rank_store
from rlsys.weight_sync.broadcast import new_custom_process_group

# Joins as SGLang's init_weights_update_group does: torch's tcp:// rendezvous, PrefixStore(group name).
ENGINE_SIDE = """
import sys, torch, torch.distributed as dist
from datetime import timedelta
from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, rendezvous
port, name = sys.argv[1], sys.argv[2]
store, rank, world = next(rendezvous(f"tcp://127.0.0.1:{port}", 1, 2, timeout=timedelta(seconds=60)))
group, _ = _new_process_group_helper(2, 1, [], dist.Backend("gloo"), PrefixStore(name, store), group_name=name,
                                     timeout=timedelta(seconds=60))
tensor = torch.full((3,), 5.0)
dist.all_reduce(tensor, group=group)
print(tensor.tolist(), flush=True)
"""


def _bind(port: int) -> None:
    with socket.socket() as other:
        other.bind(("127.0.0.1", port))


def test_a_reserved_port_is_never_free_and_an_engine_side_tcp_client_joins_its_store():
    reserved = ReservedPort("127.0.0.1")
    with pytest.raises(OSError) as taken:
        _bind(reserved.port)  # what another process choosing a port meanwhile would meet
    assert taken.value.errno == errno.EADDRINUSE
    engine = subprocess.Popen([sys.executable, "-c", ENGINE_SIDE, str(reserved.port), "sync-group"],
                              stdout=subprocess.PIPE, text=True)
    try:
        group = new_custom_process_group("gloo", "127.0.0.1", reserved.port, 0, 2, "sync-group",
                                         timedelta(seconds=60), reserved)
        tensor = torch.full((3,), 2.0)
        torch.distributed.all_reduce(tensor, group=group)
        assert tensor.tolist() == [7.0, 7.0, 7.0]
        assert engine.stdout.readline().strip() == "[7.0, 7.0, 7.0]"
        with pytest.raises(OSError):
            _bind(reserved.port)  # now the store listens there
        with pytest.raises(RuntimeError, match="already handed to a store"):
            reserved.serve_store("127.0.0.1", 2, timedelta(seconds=1))
        torch.distributed.destroy_process_group(group)
    finally:
        engine.kill()
        engine.wait()


def test_a_store_nobody_joins_fails_within_its_timeout_and_releases_the_port():
    reserved = ReservedPort("127.0.0.1")
    with pytest.raises(Exception, match="(?i)timeout|timed out"):
        rank_store(0, "127.0.0.1", reserved.port, 2, timedelta(seconds=1), reserved)
    _bind(reserved.port)  # released: nothing holds it any more
