"""`rlsys doctor` on this machine as a user runs it before a first job: the node checks (the checks
themselves: tests/unit/test_node_checks.py), ports, clocks and a collective test, on a local Ray
cluster it starts and stops."""

from pathlib import Path


def test_the_doctor_passes_this_machine_for_the_quickstart_and_leaves_nothing_behind(tiny_model_dir, tmp_path):
    """`rlsys doctor` as a user runs it before a first job (one node: its collective test is between
    two processes of it); then without a config, every node of the cluster, as a table."""
    import json
    import subprocess
    import sys

    from tests.helpers import REPO

    # The config names no run_dir (none that ships does): the doctor checks the one `rlsys train`
    # would make (runs/TIME under the working directory), and removes it after.
    done = subprocess.run([sys.executable, "-m", "rlsys.cli", "doctor", str(REPO / "configs" / "quickstart.yaml"),
                           f"model.path={tiny_model_dir}", "status.port=0", "--json"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["ok"] and report["problems"] == []
    (node,) = report["nodes"]
    assert sorted(node["report"]["roles"]) == ["engine-0", "trainer rank 0", "trainer rank 1"]
    assert node["shm_needed_bytes"] == (64 + 2 * 16) * 2**20  # the floor and the colocated sync's two 16 MiB buckets
    assert report["collectives"]["backend"] == "gloo" and len(report["collectives"]["nodes"]) == 2
    assert report["collectives"]["full_sync_s"] > 0
    assert not (tmp_path / "runs").exists()

    bare = subprocess.run([sys.executable, "-m", "rlsys.cli", "doctor"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert bare.returncode == 0, bare.stderr[-3000:]
    for shown in ("rlsys doctor: the run's nodes", "/dev/shm free (needs)", "clock vs driver",
                  "collective test (gloo, 16 MiB over 2 processes", "rlsys doctor: every check passed"):
        assert shown in bare.stdout, bare.stdout
    assert not any(tmp_path.iterdir())  # nothing written where it ran


def test_the_doctor_names_a_run_dir_it_cannot_make_as_a_blocker(tiny_model_dir, tmp_path, ray_cluster):
    """A run_dir under a file, or in /proc: one blocker row naming it (what `rlsys train` refuses),
    exit 1, and still one JSON document, never a traceback."""
    import json
    import subprocess
    import sys

    from tests.helpers import REPO

    (tmp_path / "a-file").write_text("")
    for run_dir in (tmp_path / "a-file" / "run", Path("/proc/rlsys-run")):
        done = subprocess.run([sys.executable, "-m", "rlsys.cli", "doctor", str(REPO / "configs" / "quickstart.yaml"),
                               f"model.path={tiny_model_dir}", f"run_dir={run_dir}", "status.port=0", "--json",
                               "--address", ray_cluster], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
        report = json.loads(done.stdout)
        (blocker,) = [p for p in report["problems"] if p["severity"] == "blocker"]
        assert blocker["where"] == "driver" and f"run_dir {run_dir} cannot be used: " in blocker["what"], blocker

