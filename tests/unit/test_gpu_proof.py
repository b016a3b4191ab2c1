"""The GPU proof kit's CPU twin (bench/gpu_proof.py --device cpu): the same script and the same
rlsys functions as on a GPU (gloo for NCCL, shared memory for CUDA IPC), run as the GPU machine
would run it: without Ray, SGLang or the other packages that machine lacks, so the kit never rots
between the rare runs on a lent GPU."""

import json
import subprocess
import sys

from tests.helpers import REPO

# Installed here, absent on the lent GPU machine (its package list: the device tool's KINDS.md);
# pydantic travels there as wheels (docs/gpus-and-clusters.md, "The GPU proof kit").
ABSENT_ON_THE_GPU_MACHINE = ["ray", "sglang", "flash_attn", "fastapi", "uvicorn", "math_verify", "datasets", "trl",
                             "wandb", "mlflow", "dill", "zstandard", "soundfile"]
EVERY_CHECK = {"environment", "model", "trainer_steps", "memory_train", "packed_attention", "varlen_attention",
               "ring_attention",
               "nccl_broadcast", "ipc_sync_small_pipelined", "ipc_sync_small_serial", "ipc_sync_large_pipelined",
               "ipc_sync_large_serial", "memory_sync", "sleep_wake", "speed", "step_profile", "targets", "summary"}


def test_gpu_proof_kit_runs_every_check_on_cpu_without_ray_or_sglang(tmp_path):
    out = tmp_path / "proof.jsonl"
    runner = (f"import runpy, sys\nfor name in {ABSENT_ON_THE_GPU_MACHINE!r}: sys.modules[name] = None\n"
              f"sys.argv = ['bench/gpu_proof.py', '--device', 'cpu', '--out', {str(out)!r}]\n"
              "runpy.run_path('bench/gpu_proof.py', run_name='__main__')\n")
    result = subprocess.run([sys.executable, "-c", runner], cwd=REPO, capture_output=True, text=True, timeout=600)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    by_check = {line["check"]: line for line in lines}
    failed = {name: line.get("error", line) for name, line in by_check.items() if line["ok"] is False}
    assert result.returncode == 0 and not failed, (failed, result.stderr[-3000:])
    assert set(by_check) == EVERY_CHECK
    # printed as it goes: stdout holds the same lines
    assert [json.loads(line)["check"] for line in result.stdout.splitlines() if line.startswith("{")] == \
        [line["check"] for line in lines]
    assert by_check["trainer_steps"]["describe"]["compute_dtype"] == "bfloat16"
    assert by_check["packed_attention"]["max_abs_vs_fp32"] <= by_check["packed_attention"]["bound"]
    syncs = [line for name, line in by_check.items() if name.startswith("ipc_sync")]
    assert all(not line["mismatched"] and not line["leftover_shm_files"] for line in syncs)
    assert by_check["sleep_wake"]["state_bit_identical"] and by_check["sleep_wake"]["second_cycle"]["state_bit_identical"]
    assert by_check["step_profile"]["top_cpu"] and by_check["step_profile"]["parts_s"]["reference_logprobs_s"] > 0
    # the GPU-speed figures, computed the same way on the CPU twin
    speed, ring = by_check["speed"], by_check["ring_attention"]
    assert 0 < speed["mfu_train"] and 0 < speed["mfu_step"] and speed["train_s"] < speed["parts_s"]["train_step_s"]
    assert ring["block_kernel"] == "flash_cpu" and ring["ring_vs_flash"] > 0
    assert ring["backward_max_abs_vs_exact"] <= ring["backward_bound"]
    assert by_check["sleep_wake"]["first_sleep_s"] > 0
    # the arena's size computed at setup (before AdamW had state) is what the first sleep took, FSDP2 shards and all
    assert by_check["sleep_wake"]["arena_predicted_at_setup"] == by_check["sleep_wake"]["host_bytes"]
    assert set(by_check["targets"]["figures"]) == {"mfu_train", "mfu_step", "ring_vs_flash", "first_sleep_s"}
    assert by_check["targets"]["ok"] is None  # a measurement, not a verdict
    assert by_check["nccl_broadcast"]["dist_backend"] == "gloo" and by_check["nccl_broadcast"]["buckets"] > 0
