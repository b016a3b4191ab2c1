"""The step's records live in one module that imports none of the components that pass them
around: the driver's modules never import the trainer package for a type, and the reward pool
and the reward service client do not import each other."""

import subprocess
import sys


def _modules_loaded_by(module: str) -> set[str]:
    """rlsys modules a fresh interpreter holds after importing `module`."""
    code = f"import sys, {module}; print(' '.join(m for m in sys.modules if m.startswith('rlsys')))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    return set(result.stdout.split())


def test_records_import_only_the_config():
    assert _modules_loaded_by("rlsys.records") <= {"rlsys", "rlsys.records", "rlsys.config"}


def test_the_driver_side_of_the_objective_does_not_import_the_trainer():
    loaded = _modules_loaded_by("rlsys.algorithms.samples")
    assert not {m for m in loaded if m.startswith(("rlsys.actors", "rlsys.rollout", "rlsys.rewards"))}, loaded


def test_the_reward_service_client_does_not_import_the_worker_pool():
    assert "rlsys.rewards.pool" not in _modules_loaded_by("rlsys.rewards.remote")
