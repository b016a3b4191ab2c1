"""The GPU twins of the CPU paths: CUDA IPC (colocated) and NCCL broadcast (disaggregated) weight
sync inside a real training run. Skipped without CUDA (conftest); the CPU twins of the same code
are tested by test_weight_sync.py and test_quickstart.py."""

import subprocess
import sys

import pytest
import torch

from rlsys.observability.metrics import read_metrics
from rlsys.run.handoff import engine_gave_memory_back, trainer_gave_memory_back
from tests.helpers import REPO

# Mean |engine - trainer| log-prob of the sampled tokens that bf16 rounding explains on the small test
# models: a GPU engine serves bf16 whatever model.dtype (rlsys/system/backend.py: engine_dtype).
BF16_LOGPROB_MISMATCH = 5e-2


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize(("mode", "gpus_needed"), [("colocated", 2), ("disaggregated", 4)])
def test_gpu_run_syncs_weights_every_step(tmp_path, tiny_model_dir, mode, gpus_needed):
    if torch.cuda.device_count() < gpus_needed:
        pytest.skip(f"{mode} needs {gpus_needed} GPUs")
    run_dir = tmp_path / "run"
    engines = 1 if mode == "colocated" else 2
    result = subprocess.run(
        [sys.executable, "-m", "rlsys.cli", "train", str(REPO / "configs/quickstart.yaml"),
         f"model.path={tiny_model_dir}", f"run_dir={run_dir}", "logging.progress_bar=false",
         "trainer.total_steps=20", "status.port=0", f"placement.mode={mode}", "trainer.num_ranks=2",
         f"rollout.num_engines={engines}", "weight_sync.verify=true"],
        capture_output=True, text=True, timeout=1200, cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["weight_version"] for r in rows] == list(range(20))
    # an fp32 trainer (quickstart) feeds a bf16 engine on GPUs: the bf16 cast bounds the agreement
    assert max(r["logprob_mismatch"] for r in rows) < BF16_LOGPROB_MISMATCH


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_colocated_memory_hand_off_frees_each_side_in_turn(tmp_path):
    """One GPU, memory saver on: while the engine is released the GPU's memory in use drops by (nearly)
    the weights and KV cache the engine reports (device-wide NVML: per-process figures read 0 in
    containers; the CUDA contexts stay), and the trainer's reservation halves while the engine
    generates; bf16 weights reach the engine within bf16's tolerance. The same checks as
    deploy/gpu_smoke.sh (rlsys/run/handoff.py), on its ~95 M-parameter model."""
    from rlsys.tools.tiny_model import TinyModelSpec, make_tiny_model

    model_dir = make_tiny_model(tmp_path / "model", TinyModelSpec(hidden_size=1024, num_layers=24))
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "rlsys.cli", "train", str(REPO / "configs/quickstart.yaml"),
         f"model.path={model_dir}", f"run_dir={run_dir}", "logging.progress_bar=false", "status.port=0",
         "placement.device=cuda", "trainer.num_ranks=1", "rollout.num_engines=1", "model.dtype=bfloat16",
         "trainer.total_steps=6", "weight_sync.verify=true"],
        capture_output=True, text=True, timeout=1200, cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rlsys: GPUs" in result.stdout
    rows = read_metrics(run_dir / "metrics.jsonl")
    for row in rows:
        assert engine_gave_memory_back(row), row
        assert trainer_gave_memory_back(row), row
    assert max(r["logprob_mismatch"] for r in rows) < BF16_LOGPROB_MISMATCH


@pytest.mark.gpu
def test_gpu_backend_uses_flash_attention_for_bf16_when_installed():
    from rlsys.actors.packed_attention import PACKED_SDPA
    from rlsys.system.backend import flash_attn_available, make_backend

    backend = make_backend(True, "bfloat16")
    assert backend.dist_backend == "nccl" and backend.device().type == "cuda"
    assert backend.attn_implementation == ("flash_attention_2" if flash_attn_available() else PACKED_SDPA)
    assert make_backend(True, "float32").attn_implementation == PACKED_SDPA
