"""Where each process of a run is (rlsys/system/stacks.py): real processes in a real gloo group, one
of them stopped before the collective the other waits in, read with py-spy."""

import os
import signal
import subprocess
import sys
import time

import psutil

from rlsys.system.stacks import ProcessRef, _py_spy_dump, collect_stacks, read_frames, summarize

# Rank 1 stops itself (SIGSTOP) before the all-reduce; rank 0 waits inside it.
# Rank 0 reserves the group's port and prints it (rlsys/system/rendezvous.py); rank 1 is given it.
RANK = """
import os, signal, sys, torch, torch.distributed as dist
from datetime import timedelta
from rlsys.system.rendezvous import ReservedPort, rank_store
rank = int(sys.argv[1])
reserved = ReservedPort("127.0.0.1") if rank == 0 else None
port = reserved.port if rank == 0 else int(sys.argv[2])
print(port, flush=True)
store = rank_store(rank, "127.0.0.1", port, 2, timedelta(seconds=120), reserved)
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=120))
print("joined", flush=True)
def step():
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.all_reduce(torch.ones(4))
step()
"""

PY_SPY_DUMP = """Process 42: ray::TrainerWorker.train_step
Python v3.11.7 (/usr/bin/python3.11)

Thread 42 (idle): "MainThread"
    all_reduce (torch/distributed/distributed_c10d.py:3913)
    _exception_logger.<locals>.wrapper (torch/distributed/c10d_logger.py:83)
    TrainerWorker._global_max (actors/trainer.py:289)
    TrainerWorker.train_step (actors/trainer.py:437)
    Worker.main_loop (ray/_private/worker.py:1069)
Thread 57 (idle): "PythonGCThread"
    Condition.wait (threading.py:327)
"""


def _this_node() -> str:
    """This process's Ray node id when an earlier test connected it to the session's cluster (the
    collector then reads other nodes through Ray), else any name: everything is read here."""
    from rlsys.system.node import connected_ray

    ray = connected_ray()
    return ray.get_runtime_context().get_node_id() if ray is not None else "this-node"


def test_frames_name_the_collective_and_where_rlsys_called_it():
    assert read_frames(PY_SPY_DUMP) == ("all_reduce (distributed_c10d.py:3913)",
                                        "TrainerWorker._global_max (actors/trainer.py:289)")
    idle = PY_SPY_DUMP.replace("torch/distributed/", "torch/other/").replace("actors/", "elsewhere/")
    assert read_frames(idle) == (None, None)


def test_a_stopped_rank_and_the_rank_waiting_for_it_in_a_collective_are_told_apart(tmp_path):
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, "0"], stdout=subprocess.PIPE, text=True)]
    port = ranks[0].stdout.readline().strip()
    ranks.append(subprocess.Popen([sys.executable, "-c", RANK, "1", port], stdout=subprocess.PIPE, text=True))
    try:
        assert ranks[1].stdout.readline().strip() == port
        for rank in ranks:
            assert rank.stdout.readline().strip() == "joined"
        deadline = time.monotonic() + 60
        while psutil.Process(ranks[1].pid).status() != psutil.STATUS_STOPPED:
            assert time.monotonic() < deadline, "rank 1 never stopped"
            time.sleep(0.1)
        while read_frames(_py_spy_dump(ranks[0].pid, stopped=False))[0] is None:  # on its way into the all-reduce
            assert time.monotonic() < deadline, "rank 0 never reached the all-reduce"
            time.sleep(0.2)
        here = _this_node()
        refs = [ProcessRef("driver", os.getpid(), here, "127.0.0.1")]
        refs += [ProcessRef(f"trainer rank {rank}", process.pid, here, "127.0.0.1")
                 for rank, process in enumerate(ranks)]
        found = collect_stacks(refs, tmp_path / "hang")
    finally:
        for process in ranks:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
    by_role = {s.role: s for s in found}
    assert by_role["trainer rank 0"].collective.startswith("all_reduce (distributed_c10d.py:")
    assert by_role["trainer rank 1"].state == "stopped" and by_role["trainer rank 1"].collective is None
    assert "step (<string>:" in by_role["trainer rank 1"].stacks  # read where it stopped, though stopped
    line = summarize(found)
    assert line.startswith(f"trainer rank 0 (pid {ranks[0].pid} on 127.0.0.1, ")
    assert "): inside torch.distributed all_reduce (distributed_c10d.py:" in line.split(";")[0]
    assert f"trainer rank 1 (pid {ranks[1].pid} on 127.0.0.1, stopped (SIGSTOP?)): not in a collective" in line
    assert "driver" not in line
    # the driver read itself in-process; every process has its file and the summary lists them all
    assert "test_a_stopped_rank_and_the_rank_waiting_for_it" in by_role["driver"].stacks
    names = sorted(path.name for path in (tmp_path / "hang").iterdir())
    assert names == sorted(["summary.json", f"driver-{os.getpid()}.txt", f"trainer-rank-0-{ranks[0].pid}.txt",
                            f"trainer-rank-1-{ranks[1].pid}.txt"])


# A process of rlsys's own, blocked where py-spy would find it, that answers the stack signal.
ANSWERING = """
import sys, time
from rlsys.system.stacks import answer_stack_signal
answer_stack_signal()
def waiting_for_the_others():
    print("ready", flush=True)
    time.sleep(120)
waiting_for_the_others()
"""


def test_where_py_spy_cannot_read_a_rank_the_rank_is_asked_for_its_stacks(tmp_path, monkeypatch):
    """A container without CAP_SYS_PTRACE: py-spy is refused, the rank writes its own stacks."""
    import rlsys.system.stacks as stacks

    refused = tmp_path / "py-spy"
    refused.write_text("#!/bin/sh\necho 'Error: Permission Denied: Try running again with elevated permissions' >&2\n"
                       "exit 1\n")
    refused.chmod(0o755)
    monkeypatch.setattr(stacks, "py_spy", lambda: str(refused))
    with open(tmp_path / "worker.err", "w") as err:  # as Ray gives a worker its log file for stderr
        rank = subprocess.Popen([sys.executable, "-c", ANSWERING], stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        assert rank.stdout.readline().strip() == "ready"
        (asked,) = stacks.dump_on_this_node([ProcessRef("trainer rank 0", rank.pid, "n", "127.0.0.1",
                                                        answers_signal=True)])
        (unasked,) = stacks.dump_on_this_node([ProcessRef("engine-0", rank.pid, "n", "127.0.0.1")])
        os.kill(rank.pid, signal.SIGSTOP)
        _wait_until_stopped(rank.pid)  # a loaded machine takes a moment to stop it
        (stopped,) = stacks.dump_on_this_node([ProcessRef("trainer rank 0", rank.pid, "n", "127.0.0.1",
                                                          answers_signal=True)])
        assert rank.poll() is None  # the signal asked, it did not end the process
    finally:
        os.kill(rank.pid, signal.SIGKILL)
        rank.wait()
    assert "Permission Denied" in asked.stacks and "through SIGUSR2" in asked.stacks
    assert "waiting_for_the_others (<string>:" in asked.stacks
    assert asked.where is None and asked.collective is None  # <string> is not rlsys's code nor torch's
    assert unasked.stacks.startswith("py-spy failed") and "Thread" not in unasked.stacks  # SGLang's are never signalled
    assert stopped.state == "stopped" and "it is stopped and cannot answer" in stopped.stacks


def _wait_until_stopped(pid: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while psutil.Process(pid).status() != psutil.STATUS_STOPPED:
        assert time.monotonic() < deadline, f"process {pid} did not stop within {timeout_s} s of SIGSTOP"
        time.sleep(0.01)
