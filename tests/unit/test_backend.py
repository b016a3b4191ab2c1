"""The hardware decision, made once from the Ray cluster's resources (never the driver's devices),
and the attention choice table; both computable without a GPU."""

import pytest

from rlsys.actors.packed_attention import PACKED_SDPA
from rlsys.actors.profiling import RankProfiler
from rlsys.actors.varlen_attention import PACKED_VARLEN
from rlsys.config import ConfigError, RunConfig
from rlsys.system.backend import (
    Backend,
    BackendError,
    choose_attention,
    decide_has_gpu,
    engine_attention_backend,
    engine_dtype,
    make_backend,
    torch_varlen_available,
)
from rlsys.system.topology import Topology


def _config(mode: str = "colocated", ranks: int = 2, engines: int = 2, tp: int = 1, device: str = "auto") -> RunConfig:
    return RunConfig.model_validate({
        "model": {"path": "unused"}, "data": {"synthetic": {"task": "max_digit"}},
        "placement": {"mode": mode, "device": device}, "trainer": {"num_ranks": ranks},
        "rollout": {"num_engines": engines, "engine": {"tp_size": tp}},
    })


def _decide(config: RunConfig, cluster_gpus: float) -> bool:
    layout = Topology.from_config(config, has_gpu=False)
    return decide_has_gpu(config.placement.device, cluster_gpus, layout.gpus_needed())


def test_a_gpu_cluster_is_used_whatever_the_driver_has():
    # `ray job submit`: the driver runs on a GPU-less head; the workers have the GPUs.
    assert _decide(_config(), cluster_gpus=8) is True
    topology = Topology.from_config(_config(), has_gpu=True)
    assert topology.bundles() == [{"CPU": 2, "GPU": 1}] * 2  # the bundles ask for the GPUs


def test_a_gpu_less_cluster_runs_on_cpu_unless_cuda_was_asked_for():
    assert _decide(_config(), cluster_gpus=0) is False
    with pytest.raises(BackendError, match="placement.device is cuda but the Ray cluster has no GPUs"):
        _decide(_config(device="cuda"), cluster_gpus=0)


def test_device_cpu_never_uses_gpus():
    assert _decide(_config(device="cpu"), cluster_gpus=8) is False


def test_too_few_gpus_for_the_placement_is_refused_before_it_waits_for_ever():
    assert Topology.from_config(_config("disaggregated", ranks=4, engines=2, tp=2), False).gpus_needed() == 8
    assert Topology.from_config(_config("colocated", ranks=4, engines=2), False).gpus_needed() == 4
    with pytest.raises(BackendError, match="needs 8 GPUs but the Ray cluster has 4"):
        _decide(_config("disaggregated", ranks=4, engines=2, tp=2), cluster_gpus=4)


@pytest.mark.parametrize(("has_gpu", "dtype", "flash_attn", "torch_varlen", "expected"), [
    (False, "bfloat16", True, True, PACKED_SDPA),
    (False, "float32", False, False, PACKED_SDPA),
    (True, "float32", True, True, PACKED_SDPA),  # flash kernels are 16-bit
    (True, "bfloat16", False, False, PACKED_SDPA),  # neither flash-attn nor torch's varlen
    (True, "float16", False, False, PACKED_SDPA),
    (True, "bfloat16", False, True, PACKED_VARLEN),  # no flash-attn: torch's varlen flash
    (True, "float16", False, True, PACKED_VARLEN),
    (True, "bfloat16", True, True, "flash_attention_2"),  # flash-attn first where installed
    (True, "float16", True, False, "flash_attention_2"),
])
def test_attention_is_a_flash_kernel_on_a_gpu_in_16_bit_flash_attn_first(has_gpu, dtype, flash_attn, torch_varlen,
                                                                          expected):
    assert choose_attention(has_gpu, dtype, flash_attn, torch_varlen) == expected


@pytest.mark.parametrize(("capability", "expected"), [(None, False), ((7, 5), False), ((8, 0), True), ((9, 0), True)])
def test_torch_varlen_runs_from_sm80_where_torch_has_it(capability, expected):
    # This torch (2.14) has torch.nn.attention.varlen; its flash kernels need sm80 or newer.
    assert torch_varlen_available(capability) == expected


# (GPU compute capability, engine dtype) -> --attention-backend; None: SGLang's default for that GPU.
# SGLang's defaults (fa3 on sm90, trtllm_mha on sm100, flashinfer/triton elsewhere) are 16-bit only
# or run fp32 as tf32, so an fp32 engine must never be left to them.
@pytest.mark.parametrize(("capability", "dtype", "expected"), [
    ((9, 0), "float32", "torch_native"),  # H100: SGLang's default fa3 takes fp16/bf16/fp8 only
    ((10, 0), "float32", "torch_native"),  # B200: trtllm_mha, 16-bit only
    ((8, 0), "float32", "torch_native"),  # A100: flashinfer (16-bit) or triton (tf32)
    ((8, 9), "float32", "torch_native"),
    ((7, 5), "float32", "torch_native"),
    ((9, 0), "bfloat16", None),  # the recipes: bf16 on fa3
    ((10, 0), "bfloat16", None),
    ((8, 0), "bfloat16", None),
    ((12, 0), "bfloat16", None),
    ((7, 5), "bfloat16", "torch_native"),  # T4: flashinfer's and triton's bf16 need sm80
    ((7, 0), "bfloat16", "torch_native"),
])
def test_the_engine_attention_backend_takes_the_engine_dtype(capability, dtype, expected):
    assert engine_attention_backend(True, dtype, capability) == expected


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_cpu_engine_always_gets_torch_native_attention(dtype):
    assert engine_attention_backend(False, dtype, None) == "torch_native"


def test_a_cpu_actor_gets_the_cpu_twins():
    backend = make_backend(False, "bfloat16")
    assert (backend.device_type, backend.dist_backend, backend.attn_implementation) == ("cpu", "gloo", PACKED_SDPA)
    assert backend.held_memory_bytes() > 0  # the host is the device: resident memory


def test_an_actor_told_to_use_a_gpu_it_does_not_see_fails_clearly():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(BackendError, match="this run uses GPUs but this process sees none"):
        make_backend(True, "bfloat16")


def test_engines_start_before_trainers_only_where_they_share_a_gpu():
    assert Topology.from_config(_config("colocated"), has_gpu=True).engines_start_first
    assert not Topology.from_config(_config("colocated"), has_gpu=False).engines_start_first  # side by side on CPU
    assert not Topology.from_config(_config("disaggregated"), has_gpu=True).engines_start_first


def test_colocated_tensor_parallel_engines_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="rollout.engine.tp_size must be 1"):
        _config("colocated", tp=2)
    assert _config("disaggregated", tp=2).rollout.engine.tp_size == 2


def test_load_config_reports_colocated_tp_as_a_config_error(tmp_path):
    from rlsys.config import load_config

    path = tmp_path / "c.yaml"
    path.write_text("model: {path: m}\ndata: {synthetic: {task: max_digit}}\nrollout: {engine: {tp_size: 2}}\n")
    with pytest.raises(ConfigError, match="use placement.mode=disaggregated for tensor-parallel engines"):
        load_config(path)


# (GPU, model.dtype) -> the dtype the engine serves. SGLang's CUDA RMSNorm calls sgl_kernel's rmsnorm,
# which dispatches fp16/bf16 only: a GPU engine never runs fp32, an fp32 trainer feeds it bf16.
@pytest.mark.parametrize(("has_gpu", "model_dtype", "expected"), [
    (False, "float32", "float32"),
    (False, "bfloat16", "bfloat16"),
    (True, "float32", "bfloat16"),
    (True, "bfloat16", "bfloat16"),
])
def test_a_gpu_engine_serves_bf16_whatever_the_model_dtype(has_gpu, model_dtype, expected):
    assert engine_dtype(has_gpu, model_dtype) == expected


def _gpu_backend(capability=(9, 0)) -> Backend:
    """A GPU actor's backend as make_backend(True) builds it, without CUDA (nothing here touches the device)."""
    return Backend(True, "cuda", "nccl", PACKED_SDPA, gpu_capability=capability)


def _launch_dtype(command: list[str]) -> str:
    return command[command.index("--dtype") + 1]


def _sync_dtype(spec, monkeypatch):
    """The engine dtype TrainerWorker.sync_weights hands the weight sync (the sync itself stubbed)."""
    import types

    import torch

    import rlsys.actors.trainer as trainer_module
    import rlsys.actors.weights_out as weights_out_module

    seen = {}

    def fake_sync_weights(named, plan, *args, **kwargs):
        seen["engine_dtype"] = plan.engine_dtype
        return types.SimpleNamespace(as_dict=dict)

    monkeypatch.setattr(weights_out_module, "sync_weights", fake_sync_weights)
    models = types.SimpleNamespace(model=torch.nn.Linear(2, 2), lora=False, released_name=str, checkpoint_pieces=None)
    worker = types.SimpleNamespace(spec=spec, models=models, weights_out=weights_out_module.WeightsOut(_gpu_backend()),
                                   profiler=RankProfiler(_gpu_backend(), rank=0))
    trainer_module.TrainerWorker.sync_weights(worker, 2**20, weight_version=1)
    return seen["engine_dtype"]


@pytest.mark.parametrize(("has_gpu", "model_dtype", "expected"), [
    (True, "float32", "bfloat16"),  # make quickstart on a GPU host: fp32 trainer, bf16 engine
    (True, "bfloat16", "bfloat16"),
    (False, "float32", "float32"),
])
def test_the_engine_launch_and_the_trainer_sync_agree_on_the_engine_dtype(has_gpu, model_dtype, expected, monkeypatch):
    import torch

    from rlsys.actors.trainer import TrainerSpec
    from rlsys.rollout.sglang.server import ServerSpec, build_command

    config = _config()
    config = config.model_copy(update={"model": config.model.model_copy(update={"dtype": model_dtype})})
    server = ServerSpec(config.model, config.rollout.engine, has_gpu=has_gpu)
    backend = _gpu_backend() if has_gpu else make_backend(False)
    command = build_command(server, backend, "127.0.0.1", 1)
    assert _launch_dtype(command) == server.dtype == expected
    # the attention backend follows the served dtype: SGLang's own fa3 for bf16 on an H100
    assert ("--attention-backend" in command) == (not has_gpu)
    trainer = TrainerSpec.from_config(config, has_gpu=has_gpu)
    assert _sync_dtype(trainer, monkeypatch) == getattr(torch, expected)


def test_an_engine_start_may_take_longer_on_gpus_unless_set():
    from rlsys.config import CPU_STARTUP_TIMEOUT_S, GPU_STARTUP_TIMEOUT_S, EngineConfig, ModelConfig
    from rlsys.rollout.sglang.server import ServerSpec

    model = ModelConfig(path="unused")
    assert ServerSpec(model, has_gpu=False).startup_timeout_s == CPU_STARTUP_TIMEOUT_S == 300
    assert ServerSpec(model, has_gpu=True).startup_timeout_s == GPU_STARTUP_TIMEOUT_S == 1800
    for has_gpu in (False, True):
        assert ServerSpec(model, EngineConfig(startup_timeout_s=42), has_gpu=has_gpu).startup_timeout_s == 42


def _probe_node(tmp_path):
    from rlsys.system.node_checks import probe_this_node

    run_dir, model = tmp_path / "run", tmp_path / "model"
    run_dir.mkdir()
    model.mkdir()
    (model / "config.json").write_text("{}")
    (run_dir / "marker").write_text("token")
    return probe_this_node(str(run_dir), "marker", "token", (str(model),), "node", ("trainer rank 0",))


@pytest.mark.parametrize("transformers_says", [True, False])
def test_a_gpu_node_reports_flash_attn_as_transformers_decides_it(tmp_path, monkeypatch, transformers_says):
    """The memory plan counts flash-attn only where the trainer ranks will run it: both ask one function."""
    import transformers.utils

    import rlsys.system.node_checks as node_checks
    from rlsys.system.backend import flash_attn_available

    monkeypatch.setattr(node_checks, "read_gpus",
                        lambda: (node_checks.GpuInfo(0, "NVIDIA H100", 80 * 2**30, "default", "580.1", "13.0"),))
    # e.g. a flash_attn package older than transformers accepts, or none at all while transformers finds one
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: transformers_says)
    assert flash_attn_available() is transformers_says
    assert _probe_node(tmp_path).flash_attn_installed is transformers_says


def test_a_node_without_gpus_runs_no_flash_attn(tmp_path, monkeypatch):
    import transformers.utils

    import rlsys.system.node_checks as node_checks

    monkeypatch.setattr(node_checks, "read_gpus", lambda: ())
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: True)
    assert _probe_node(tmp_path).flash_attn_installed is False
