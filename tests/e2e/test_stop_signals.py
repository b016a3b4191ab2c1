"""Stopping a whole run with a signal to its process group: SIGTERM to the group (what Kubernetes,
SLURM's scancel, `timeout` and most job runners send) stops after the current step, with a
checkpoint, as SIGTERM to the driver does, though it also reaches the local Ray cluster's processes
and the reward workers. (Ctrl-C in tests/e2e/test_faults.py; the signal handling and the shielded
children on stand-in processes: tests/unit/test_stop_signals.py.)"""

import json
import os
import signal

import pytest

from tests.e2e.test_faults import _wait_for_steps
from tests.helpers import started_run


@pytest.mark.own_engines
def test_sigterm_to_the_whole_process_group_stops_as_sigterm_to_the_driver_does(leftovers, tmp_path, tiny_model_dir):
    """What Kubernetes, SLURM's scancel, `timeout` and job runners send: it also reaches the local
    Ray cluster's processes and the reward workers, which must leave the stop to the driver."""
    run_dir = tmp_path / "run"
    with started_run("quickstart.yaml", tiny_model_dir, run_dir, "trainer.total_steps=2000",
                     own_process_group=True) as run:
        _wait_for_steps(run, run_dir, 2)
        os.killpg(run.pid, signal.SIGTERM)
        stdout, stderr = run.communicate(timeout=300)
    assert run.returncode == 0, stderr[-3000:]
    assert "rlsys: SIGTERM: stopping after this step, with a checkpoint" in stdout
    assert "Traceback" not in stderr + stdout
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "stopped"
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints[-1] == f"step_{len(steps):08d}"  # the last finished step is saved
    assert leftovers.processes() == [] and leftovers.shm_files() == []
