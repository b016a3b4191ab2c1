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


def test_every_package_is_installed_by_a_wheel():
    """pyproject.toml lists packages by name (actors/, rollout/ and weight_sync/ are mapped under
    rlsys): a folder of modules left off the list is missing from `pip install .`, though an
    editable install (`make install`) finds it."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = set()
    for folder in ("rlsys", "actors", "rollout", "weight_sync"):
        for path in (REPO / folder).rglob("*.py"):
            parts = path.parent.relative_to(REPO).parts
            folders.add(".".join(parts if parts[0] == "rlsys" else ("rlsys", *parts)))
    assert folders - listed == set()
