"""What `import rlsys` exposes, installed or run from a source tree (a Ray job's working_dir)."""

import subprocess
import sys

from tests.helpers import REPO

PROBE = """
import importlib, rlsys, rlsys.actors, rlsys.rollout.sglang, rlsys.weight_sync
print(rlsys.actors.__file__, rlsys.rollout.sglang.__file__, rlsys.weight_sync.__file__)
for name in ("rlsys.tests", "rlsys.rlsys", "rlsys.bench", "rlsys.configs"):
    try:
        importlib.import_module(name)
        print("IMPORTED", name)
    except ModuleNotFoundError:
        pass
"""


def _probe(*python_flags: str, env: dict | None = None) -> str:
    result = subprocess.run([sys.executable, *python_flags, "-c", PROBE], capture_output=True, text=True, cwd="/",
                            env=env, check=True)
    return result.stdout


def test_the_three_top_level_folders_import_under_rlsys_and_nothing_else_does():
    out = _probe()
    assert str(REPO / "actors") in out and str(REPO / "rollout" / "sglang") in out and str(REPO / "weight_sync") in out
    assert "IMPORTED" not in out


def test_a_source_tree_that_is_not_installed_imports_the_same_folders():
    # -S: no site-packages, so no installed mapping; the tree is found through PYTHONPATH alone
    out = _probe("-S", env={"PYTHONPATH": str(REPO)})
    assert str(REPO / "actors") in out and str(REPO / "weight_sync") in out
    assert "IMPORTED" not in out
