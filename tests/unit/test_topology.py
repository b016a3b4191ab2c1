"""The run's layout, computed from the config without a Ray cluster: bundles, slots, who feeds
whom; and how the rollout manager deals prompts to engines and puts the answers back in order."""

import pytest

from rlsys.config import RunConfig
from rlsys.rollout.sglang.client import EngineAddress
from rlsys.system.topology import Topology


def _config(mode: str, ranks: int, engines: int, tp: int = 1, offload: bool | None = None) -> RunConfig:
    return RunConfig.model_validate({
        "model": {"path": "unused"}, "data": {"synthetic": {"task": "max_digit"}},
        "placement": {"mode": mode}, "trainer": {"num_ranks": ranks, "offload_between_steps": offload},
        "rollout": {"num_engines": engines, "engine": {"tp_size": tp}},
    })


def test_colocated_rank_and_engine_share_a_bundle_and_half_its_gpu():
    topology = Topology.from_config(_config("colocated", ranks=2, engines=2), has_gpu=True)
    assert topology.bundles() == [{"CPU": 2, "GPU": 1}, {"CPU": 2, "GPU": 1}]
    assert [topology.trainer_slot(r) for r in range(2)] == [topology.engine_slot(i) for i in range(2)]
    assert topology.trainer_slot(1).bundle == 1 and topology.trainer_slot(1).gpus == 0.5
    assert topology.transport == "ipc" and topology.trainers_sleep


def test_disaggregated_engines_get_their_own_bundles_after_the_trainers():
    topology = Topology.from_config(_config("disaggregated", ranks=2, engines=3, tp=2), has_gpu=True)
    assert topology.bundles() == [{"CPU": 1, "GPU": 1}] * 2 + [{"CPU": 1, "GPU": 2}] * 3
    assert [topology.engine_slot(i).bundle for i in range(3)] == [2, 3, 4]
    assert topology.engine_slot(0).gpus == 2
    assert topology.transport == "broadcast"
    assert not topology.trainers_sleep  # trainers keep their own GPUs


def test_cpu_runs_ask_for_no_gpus_and_count_their_cpus():
    topology = Topology.from_config(_config("colocated", ranks=2, engines=1), has_gpu=False)
    assert topology.bundles() == [{"CPU": 2}, {"CPU": 2}]
    assert topology.trainer_slot(0).gpus == 0 and topology.engine_slot(0).gpus == 0
    assert topology.local_cpus() == 5  # 2 bundles of 2 CPUs, and a spare
    disaggregated = Topology.from_config(_config("disaggregated", ranks=2, engines=2), has_gpu=False)
    assert disaggregated.local_cpus() == 5


def test_rank_i_feeds_engine_i_and_the_other_ranks_only_gather():
    topology = Topology.from_config(_config("colocated", ranks=4, engines=2), has_gpu=False)
    assert [topology.engine_fed_by(r) for r in range(4)] == [0, 1, None, None]
    assert topology.gather_dst is None  # two ranks need full tensors: all-gather
    single = Topology.from_config(_config("colocated", ranks=2, engines=1), has_gpu=False)
    assert single.gather_dst == 0  # only rank 0 needs them: shards go to it alone
    broadcast = Topology.from_config(_config("disaggregated", ranks=2, engines=2), has_gpu=False)
    assert [broadcast.engine_fed_by(r) for r in range(2)] == [None, None] and broadcast.gather_dst == 0


def test_cpu_threads_colocated_phases_take_turns_disaggregated_sides_share():
    colocated = Topology.from_config(_config("colocated", ranks=2, engines=1), has_gpu=False)
    assert colocated.cpu_sharers(["a", "a"]) == (2, 1)  # 2 ranks train together; the engine generates alone
    assert colocated.cpu_sharers(["a", "b"]) == (1, 1)  # one rank per node
    one_rank = Topology.from_config(_config("colocated", ranks=1, engines=1), has_gpu=False)
    assert one_rank.cpu_sharers(["a"]) == (1, 1)  # each phase gets every core
    disaggregated = Topology.from_config(_config("disaggregated", ranks=1, engines=1), has_gpu=False)
    assert disaggregated.cpu_sharers(["a", "a"]) == (2, 2)  # both sides on one node: half each
    assert disaggregated.cpu_sharers(["a", "b"]) == (1, 1)
    wide = Topology.from_config(_config("disaggregated", ranks=2, engines=2, tp=2), has_gpu=False)
    assert wide.cpu_sharers(["a", "a", "b", "a"]) == (4, 4)  # node a: 2 ranks and a tp-2 engine


def test_threads_divide_the_nodes_cores_unless_set():
    from rlsys.actors.trainer import TrainerSpec
    from rlsys.config import EngineConfig, ModelConfig, TrainerConfig
    from rlsys.rollout.sglang.server import ServerSpec

    model = ModelConfig(path="unused")
    assert TrainerSpec(model, cpu_sharers=2).threads(node_cores=8) == 4
    assert TrainerSpec(model, cpu_sharers=3).threads(node_cores=2) == 1  # never below one
    assert TrainerSpec(model).threads(node_cores=8) == 1  # a standalone group: one thread
    assert TrainerSpec(model, TrainerConfig(threads_per_rank=3), cpu_sharers=2).threads(node_cores=8) == 3
    assert ServerSpec(model, cpu_sharers=1).threads(node_cores=2) == 2
    assert ServerSpec(model, EngineConfig(threads=1), cpu_sharers=1).threads(node_cores=2) == 1


def test_a_cpu_engine_server_starts_with_its_thread_budget():
    import os

    from rlsys.config import ModelConfig
    from rlsys.rollout.sglang.server import ServerSpec, build_env
    from rlsys.system.backend import make_backend

    cores = len(os.sched_getaffinity(0))
    env = build_env(ServerSpec(ModelConfig(path="unused"), cpu_sharers=1), make_backend(False))
    assert env["OMP_NUM_THREADS"] == str(cores)  # SGLang's scheduler takes its torch threads from here
    env = build_env(ServerSpec(ModelConfig(path="unused")), make_backend(False))
    assert env["OMP_NUM_THREADS"] == "1"  # a standalone engine: one thread


def test_a_colocated_syncs_host_copy_takes_half_the_cores_pipelined_and_all_of_them_serial():
    """Pipelined, the trainers gather the next bucket while the engine copies this one in."""
    import os

    from rlsys.config import EngineConfig, ModelConfig
    from rlsys.rollout.sglang.server import ServerSpec, build_env
    from rlsys.system.backend import make_backend
    from rlsys.weight_sync.engine_loader import LOAD_THREADS_ENV

    cores = len(os.sched_getaffinity(0))
    model = ModelConfig(path="unused")
    assert build_env(ServerSpec(model), make_backend(False))[LOAD_THREADS_ENV] == str(max(1, cores // 2))
    assert build_env(ServerSpec(model, pipelined_sync=False), make_backend(False))[LOAD_THREADS_ENV] == str(cores)
    chosen = ServerSpec(model, EngineConfig(weight_load_threads=3))
    assert build_env(chosen, make_backend(False))[LOAD_THREADS_ENV] == "3"


def test_colocated_trainers_sleep_by_default_only_on_gpus():
    assert Topology.from_config(_config("colocated", 2, 1), has_gpu=True).trainers_sleep
    assert not Topology.from_config(_config("colocated", 2, 1), has_gpu=False).trainers_sleep  # one memory
    assert Topology.from_config(_config("colocated", 2, 1, offload=True), has_gpu=False).trainers_sleep


def test_offload_off_keeps_colocated_trainers_awake():
    assert not Topology.from_config(_config("colocated", 2, 1, offload=False), has_gpu=False).trainers_sleep


def test_engine_addresses_are_attached_once_and_must_match_the_count():
    topology = Topology.from_config(_config("colocated", ranks=2, engines=2), has_gpu=False)
    engines = [EngineAddress(f"engine-{i}", f"http://127.0.0.1:{9000 + i}") for i in range(2)]
    assert topology.with_engines(engines).engines == tuple(engines)
    assert topology.engines == ()  # the original is unchanged
    with pytest.raises(ValueError, match="1 engine addresses for 2 engines"):
        topology.with_engines(engines[:1])


def test_slots_outside_the_layout_are_refused():
    topology = Topology.from_config(_config("disaggregated", ranks=2, engines=1), has_gpu=False)
    with pytest.raises(IndexError):
        topology.trainer_slot(2)
    with pytest.raises(IndexError):
        topology.engine_slot(1)
    with pytest.raises(ValueError, match="engine per trainer rank"):
        Topology("colocated", num_ranks=1, num_engines=2, engine_tp_size=1, has_gpu=False, trainers_sleep=True)
