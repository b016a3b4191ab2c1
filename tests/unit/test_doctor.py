"""`rlsys doctor`'s judgements over node reports (rlsys/doctor/examine.py) and its network probes
(rlsys/system/net_checks.py); the whole command runs in tests/e2e/test_node_checks.py (this machine)
and tests/e2e/test_multinode.py (a cluster with a broken node of each kind)."""

import socket

import pytest

from rlsys.config import RunConfig
from rlsys.doctor.examine import (
    MiB,
    NodeRow,
    _scratch_directory,
    broadcast_bound,
    clock_problems,
    gpu_problems,
    shm_needed,
    shm_problems,
    status_port_problems,
    version_problems,
)
from rlsys.system.net_checks import NodeAgent, all_reduce_bus_bandwidth, connect_problem
from rlsys.system.node_checks import GpuInfo, NodeReport
from rlsys.system.topology import Topology

VERSIONS = {"python": "3.11.7", "torch": "2.14.1", "sglang": "0.5.23", "transformers": "5.19.0", "ray": "2.60.0",
            "flash_attn": None}


def _row(address, roles=("engine-0",), versions=None, shm_free=8 * 2**30, shm_needed=64 * MiB, gpus=(), skew=None):
    report = NodeReport(node_id=address, address=address, hostname=f"host-{address[-1]}", roles=tuple(roles),
                        run_dir_problem=None, model_problem=None, host_memory_bytes=64 * 2**30,
                        gpu_memory_bytes=None, flash_attn_installed=False, cpus=8, shm_total_bytes=8 * 2**30,
                        shm_free_bytes=shm_free, gpus=tuple(gpus), versions={**VERSIONS, **(versions or {})})
    return NodeRow(report, shm_needed, clock_skew_s=skew)


def _config(**overrides) -> RunConfig:
    return RunConfig.model_validate({"model": {"path": "/models/m"}, "data": {"synthetic": {"task": "last_digit"}},
                                     **overrides})


def test_a_node_with_another_version_is_named_against_the_others_and_the_driver():
    rows = [_row("10.0.0.11"), _row("10.0.0.12", versions={"sglang": "0.5.22"}), _row("10.0.0.13")]
    (problem,) = version_problems(rows, dict(VERSIONS))
    assert problem.severity == "blocker" and problem.where == "node 10.0.0.12 (host-2; engine-0)"
    assert problem.what == "sglang 0.5.22 here, 0.5.23 on the driver and the other nodes"
    assert "pip install 'sglang==0.5.23'" in problem.fix


def test_a_driver_out_of_step_with_every_node_is_named_too():
    rows = [_row("10.0.0.11", versions={"torch": "2.15.0"}), _row("10.0.0.12", versions={"torch": "2.15.0"})]
    (problem,) = version_problems(rows, dict(VERSIONS))
    assert problem.where == "driver" and problem.what == "torch 2.14.1 on the driver, 2.15.0 on the nodes"


def test_missing_packages_block_only_where_the_run_imports_them():
    rows = [_row("10.0.0.11", roles=("trainer rank 0",), versions={"sglang": None}),
            _row("10.0.0.12", roles=("engine-0",), versions={"sglang": None}),
            _row("10.0.0.13", roles=("engine-1",), versions={"torch": None})]
    problems = version_problems(rows, dict(VERSIONS))
    assert [(p.where.split(" (")[0], p.what.split(" is not")[0]) for p in problems] == \
        [("node 10.0.0.12", "sglang"), ("node 10.0.0.13", "torch")]


def test_another_flash_attn_is_a_warning():
    rows = [_row("10.0.0.11", versions={"flash_attn": "2.8.3"}), _row("10.0.0.12", versions={"flash_attn": "2.7.4"}),
            _row("10.0.0.13", versions={"flash_attn": "2.8.3"})]
    (problem,) = version_problems(rows, {**VERSIONS, "flash_attn": None})
    assert problem.severity == "warning" and "10.0.0.12" in problem.where


def test_shm_need_counts_the_colocated_cpu_staging_buffers():
    config = _config(weight_sync={"bucket_size_mb": 16})
    colocated_cpu = Topology.from_config(config, has_gpu=False)
    assert shm_needed(config, colocated_cpu, ("trainer rank 0", "engine-0")) == 64 * MiB + 2 * 16 * MiB
    assert shm_needed(config, colocated_cpu, ("trainer rank 1",)) == 64 * MiB  # no engine: nothing staged here
    gpu = Topology.from_config(_config(placement={"mode": "disaggregated"}), has_gpu=True)
    assert shm_needed(config, gpu, ("engine-0",)) == 1024 * MiB
    rows = [_row("10.0.0.11", shm_free=96 * MiB, shm_needed=96 * MiB), _row("10.0.0.12", shm_free=95 * MiB,
                                                                           shm_needed=96 * MiB)]
    (problem,) = shm_problems(rows)
    assert "10.0.0.12" in problem.where and "/dev/shm has 95 MiB free of 8.0 GiB; the run needs 96 MiB" in problem.what
    assert "--shm-size" in problem.fix


def test_gpu_compute_modes_that_stop_a_run_are_blockers():
    def gpu(index, mode, name="NVIDIA H100 80GB HBM3"):
        return GpuInfo(index, name, 80 * 2**30, mode, "580.65", "13.0")

    rows = [_row("10.0.0.11", gpus=[gpu(0, "default"), gpu(1, "exclusive_process")]),
            _row("10.0.0.12", gpus=[gpu(0, "prohibited", "NVIDIA H200")])]
    colocated = gpu_problems(rows, True, _config())
    assert [(p.severity, p.where.split(" (")[0]) for p in colocated] == \
        [("blocker", "node 10.0.0.11"), ("blocker", "node 10.0.0.12"), ("warning", "cluster")]
    assert "share each GPU" in colocated[0].what and "nvidia-smi -i 1 -c DEFAULT" in colocated[0].fix
    disaggregated = gpu_problems(rows, True, _config(placement={"mode": "disaggregated"}))
    assert [p.where.split(" (")[0] for p in disaggregated if p.severity == "blocker"] == ["node 10.0.0.12"]
    assert gpu_problems(rows, False, _config()) == []


def test_clock_skew_beyond_a_second_is_a_warning():
    problems = clock_problems([_row("10.0.0.11", skew=0.2), _row("10.0.0.12", skew=-3.5), _row("10.0.0.13")])
    assert [(p.severity, p.where.split(" (")[0], p.what) for p in problems] == \
        [("warning", "node 10.0.0.12", "its clock is -3.50 s off the driver's")]


def test_a_status_port_in_use_on_the_driver_is_a_blocker():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        (problem,) = status_port_problems(_config(status={"port": port}))
        assert problem.where == "driver" and f"status.port {port}" in problem.what and "status.port=0" in problem.fix
    assert status_port_problems(_config(status={"port": 0})) == []
    assert status_port_problems(_config(status={"enabled": False, "port": port})) == []


def test_the_bandwidth_bound_is_a_bucket_within_the_sync_timeout():
    bound, why = broadcast_bound(_config(weight_sync={"bucket_size_mb": 512, "timeout_s": 60}))
    assert bound == 512 * MiB / 60 and "512 MiB" in why and "60 s" in why
    assert broadcast_bound(None) == (None, "")
    # nccl-tests' bus bandwidth: 2 (n - 1) / n of the algorithm bandwidth
    assert all_reduce_bus_bandwidth(10**9, 1.0, 4) == pytest.approx(1.5e9)


def test_the_scratch_run_dir_is_removed_with_only_what_it_made(tmp_path):
    (tmp_path / "kept").mkdir()
    with _scratch_directory(tmp_path / "kept" / "new" / "run") as run_dir:
        assert run_dir.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"] and not any((tmp_path / "kept").iterdir())
    with _scratch_directory(tmp_path / "kept" / "run") as run_dir:
        (run_dir / "a-file").write_text("")  # something else wrote there meanwhile: left as it is
    assert (tmp_path / "kept" / "run" / "a-file").exists()


def test_an_agent_reaches_an_open_port_and_names_a_closed_one():
    agent = NodeAgent(has_gpu=False)
    host, port = agent.open_port()
    with socket.socket() as closed:
        closed.bind((host, 0))
        closed_port = closed.getsockname()[1]
    try:
        reached = agent.reach([(host, port), (host, closed_port)], timeout_s=2.0)
    finally:
        agent.close_port()
    assert reached[f"{host}:{port}"] is None
    assert reached[f"{host}:{closed_port}"] == "Connection refused"
    assert connect_problem(host, port, 1.0) == "Connection refused"  # closed with the agent's socket
