"""The deploy files agree with what a cluster run needs (what a CPU machine can check of them; the
image itself is built on a machine with Docker Hub and a GPU)."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from rlsys.config import load_config
from tests.helpers import REPO


def _rayjob() -> dict:
    return yaml.safe_load((REPO / "deploy/rayjob.yaml").read_text())


def _mounts(pod_template: dict) -> dict[str, str]:
    """mountPath -> claim name of every PVC-backed mount of the pod's first container."""
    spec = pod_template["spec"]
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"]
              if "persistentVolumeClaim" in v}
    return {m["mountPath"]: claims[m["name"]] for m in spec["containers"][0]["volumeMounts"] if m["name"] in claims}


def _under(path: str, mounts: dict[str, str]) -> str | None:
    return next((mount for mount in mounts if Path(path).is_relative_to(mount)), None)


def test_every_path_the_rayjob_run_reads_or_writes_is_the_same_volume_on_every_node():
    job = _rayjob()
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:4] == ["python", "-m", "rlsys.cli", "train"]
    config = load_config(REPO / argv[4], argv[5:])
    cluster = job["spec"]["rayClusterSpec"]
    head = _mounts(cluster["headGroupSpec"]["template"])
    workers = [_mounts(group["template"]) for group in cluster["workerGroupSpecs"]]
    paths = {"model.path": config.model.path, "data.train_path": config.data.train_path,
             "data.eval_path": config.data.eval_path, "run_dir": config.run_dir}
    for field, path in paths.items():
        assert path and Path(path).is_absolute(), f"{field} must be an absolute path on a mounted volume: {path}"
        mount = _under(path, head)
        assert mount, f"{field} {path} is on no volume of the head"
        for group in workers:
            assert group.get(mount) == head[mount], f"{field} {path}: workers must mount claim {head[mount]} there"
    assert cluster["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"  # the driver plans from the workers' GPUs


def _gib(quantity: str) -> int:
    assert quantity.endswith("Gi"), quantity
    return int(quantity[:-2]) * 2**30


def test_the_worker_pod_holds_the_plans_host_memory_per_node_with_the_headroom_it_states(tmp_path):
    """The worker's memory limit against `rlsys plan`'s host memory per node for the job's config, on
    80 GB GPUs: its model (Qwen2.5-1.5B, published shapes) and Qwen2.5-7B, which the comment sizes
    it for too, each with the stated headroom (4 GiB per GPU process, 8 GiB besides); the comment's
    figures are the plan's."""
    from rlsys.model.shape import ModelShape
    from rlsys.plan.memory_plan import plan_memory
    from tests.unit.test_memory_plan import QWEN

    text = (REPO / "deploy/rayjob.yaml").read_text()
    job = _rayjob()
    argv = shlex.split(job["spec"]["entrypoint"])
    assert "Qwen2.5-1.5B" in argv[5]
    worker = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    limits = worker["resources"]["limits"]
    gpus, memory = int(limits["nvidia.com/gpu"]), _gib(limits["memory"])
    for name in ("1.5b", "7b"):
        model_dir = tmp_path / name
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(dict(
            architectures=["Qwen2ForCausalLM"], model_type="qwen2", max_position_embeddings=32768, **QWEN[name])))
        config = load_config(REPO / argv[4], [*argv[5:], f"model.path={model_dir}"])
        plan = plan_memory(config, ModelShape.from_model_dir(model_dir), 80 * 2**30, on_gpu=True,
                           flash_attention=True, gpus_per_node=gpus)
        assert plan.ranks_per_node == gpus == config.trainer.num_ranks  # one node of the job's GPUs
        headroom = 4 * 2**30 * 2 * plan.ranks_per_node + 8 * 2**30  # a trainer rank and an engine per GPU
        assert plan.host_per_node_bytes + headroom <= memory, (name, plan.host_per_node_bytes / 2**30)
        per_node = f"{plan.host_per_node_bytes / 2**30:.1f} GiB + headroom {headroom // 2**30} GiB"
        assert per_node in text, per_node


def test_the_image_installs_a_python_that_rlsys_supports_and_leaves_local_state_out():
    dockerfile = (REPO / "deploy/Dockerfile").read_text()
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'requires-python = ">=3.11,<3.12"' in pyproject
    base = re.search(r"^FROM (\S+)", dockerfile, re.M).group(1)
    if "ubuntu24.04" in base:  # its archive has Python 3.12 only: 3.11 must come from elsewhere
        assert not re.search(r"apt-get install[^\n]*python3\.11", dockerfile)
    assert "uv venv --python 3.11" in dockerfile and "sys.version_info[:2] == (3, 11)" in dockerfile
    torch_cuda = re.search(r"nvidia/cuda:(\d+\.\d+)", base).group(1)
    assert torch_cuda == "13.0"  # torch 2.14.1's PyPI wheels are built for CUDA 13.0 (flash-attn compiles against it)
    ignored = set((REPO / ".dockerignore").read_text().split())
    assert {".venv", ".cache", "runs", ".git", "test-artifacts"} <= ignored


def test_make_installs_on_python_3_11_and_names_a_wrong_one(tmp_path):
    checked = subprocess.run(["make", "-s", "check-python"], cwd=REPO, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    # An interpreter that reports 3.12 (this one, told so before it runs the check).
    python312 = tmp_path / "python3.12"
    python312.write_text(f"#!/bin/sh\nexec {sys.executable} -c \"import sys; sys.version_info = (3, 12, 0); "
                         "exec(sys.argv[1])\" \"$2\"\n")
    python312.chmod(0o755)
    wrong = subprocess.run(["make", "-s", "check-python", f"PYTHON={python312}"], cwd=REPO, capture_output=True,
                           text=True)
    assert wrong.returncode != 0 and "needs Python 3.11" in wrong.stderr and "is 3.12" in wrong.stderr
    install_gpu = (REPO / "Makefile").read_text().split("\ninstall-gpu:")[1].splitlines()[0]
    assert "check-python" in install_gpu  # the GPU install checks the interpreter too


def test_the_gpu_smoke_test_finds_python_without_a_repository_venv(tmp_path):
    """In the image there is no .venv: the script takes the python on PATH, and on this GPU-less
    machine stops at its first check, saying why."""
    copy = tmp_path / "rlsys"
    shutil.copytree(REPO / "deploy", copy / "deploy")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")  # as the image's venv on PATH
    (bin_dir / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"}
    env.pop("PYTHON", None)
    result = subprocess.run(["bash", str(copy / "deploy/gpu_smoke.sh")], capture_output=True, text=True, env=env,
                            timeout=120)
    assert result.returncode != 0
    assert "gpu_smoke: no CUDA device visible" in result.stderr, result.stderr
