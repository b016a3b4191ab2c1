"""`ray job submit` (deploy/submit.sh) against a real Ray head on loopback: the session's cluster,
through its dashboard's job server; the run attaches to the session's quickstart engines."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from rlsys.observability.metrics import read_metrics
from tests.helpers import REPO


def test_ray_job_submit_runs_the_quickstart_to_success(ray_address, ray_dashboard, quickstart_engines, tiny_model_dir,
                                                       tmp_path):
    address = ray_dashboard
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    run_dir = tmp_path / "run"
    submit = subprocess.run(
        [str(REPO / "deploy/submit.sh"), "--address", address, "configs/quickstart.yaml",
         f"model.path={tiny_model_dir}", f"run_dir={run_dir}", "trainer.total_steps=6", "eval.interval=3",
         "status.port=0", "logging.progress_bar=false", quickstart_engines,
         # named: the job's driver was given the newest cluster on this machine (/tmp/ray/ray_current_cluster),
         # and make test's other stream starts clusters of its own beside this one (one did, at 16:28:40 in a
         # fresh-clone run, and the run failed on that cluster's token); a real head runs one cluster
         ray_address],
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
