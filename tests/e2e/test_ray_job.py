"""`ray job submit` against a real Ray head on loopback, started and stopped by this test only."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from rlsys.observability.metrics import read_metrics
from tests.helpers import REPO, ports_outside_the_ephemeral_range

RAY = str(Path(sys.executable).parent / "ray")


def _stop_head(temp_dir: str) -> None:
    """Stop only this head: every process whose command line names its temp dir (never `ray stop`)."""
    victims = []
    for proc in psutil.process_iter(["cmdline"]):
        if temp_dir in " ".join(proc.info["cmdline"] or []):
            victims.append(proc)
    for proc in victims:
        for child in proc.children(recursive=True):
            victims.append(child)
    for proc in victims:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(victims, timeout=3)  # some of them ignore SIGTERM: not what this test is about
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass


@pytest.fixture
def ray_head():
    temp_dir = tempfile.mkdtemp(prefix="rj", dir="/tmp")  # short: Ray's socket paths have a length limit
    ports = ports_outside_the_ephemeral_range(9)  # ray start binds them itself, seconds later
    gcs, dashboard, agent, agent_grpc, client, metrics, node_manager, object_manager, runtime_env = ports
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    subprocess.run(
        [RAY, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}", "--num-cpus=6",
         "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
         f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
         f"--ray-client-server-port={client}", f"--metrics-export-port={metrics}",
         f"--node-manager-port={node_manager}", f"--object-manager-port={object_manager}",
         f"--runtime-env-agent-port={runtime_env}", f"--temp-dir={temp_dir}", "--disable-usage-stats"],
        env=env, check=True, capture_output=True, timeout=180,
    )
    try:
        yield f"http://127.0.0.1:{dashboard}", env
    finally:
        _stop_head(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_ray_job_submit_runs_the_quickstart_to_success(ray_head, tiny_model_dir, tmp_path):
    address, env = ray_head
    run_dir = tmp_path / "run"
    submit = subprocess.run(
        [str(REPO / "deploy/submit.sh"), "--address", address, "configs/quickstart.yaml",
         f"model.path={tiny_model_dir}", f"run_dir={run_dir}", "trainer.total_steps=6", "eval.interval=3",
         "status.port=0", "logging.progress_bar=false"],
        env=env, capture_output=True, text=True, timeout=900, cwd=REPO,
    )
    assert submit.returncode == 0, submit.stdout[-3000:] + submit.stderr[-3000:]
    job_id = next(line.split("'")[1] for line in submit.stdout.splitlines() if "submitted successfully" in line)

    from ray.job_submission import JobStatus, JobSubmissionClient

    os.environ["RAY_AUTH_MODE"] = "disabled"
    client = JobSubmissionClient(address)
    deadline = time.monotonic() + 60
    while client.get_job_status(job_id) not in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
        assert time.monotonic() < deadline, "the job never reached a final state"
        time.sleep(1)
    assert client.get_job_status(job_id) == JobStatus.SUCCEEDED
    logs = client.get_job_logs(job_id)
    assert f"run directory {run_dir}" in logs and "rlsys: finished" in logs

    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(6))
    assert json.loads((run_dir / "status.json").read_text())["state"] == "finished"
