"""model.path as a Hugging Face hub id, resolved through the hub cache offline
(rlsys/system/model_source.py). The cache is filled in the layout `hf download` leaves."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlsys.system.node_checks import HubSnapshot, _model_problem
from tests.helpers import fill_hub_cache, refused_by_cli, write_config

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture
def hub_cache(tmp_path, tiny_model_dir, monkeypatch):
    cache = tmp_path / "hub"
    fill_hub_cache(cache, "tiny-org/tiny-qwen", tiny_model_dir, COMMIT)
    fill_hub_cache(cache, "tiny-org/tiny-qwen", tiny_model_dir, OTHER, branch="v2")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def _resolved(config_path: Path) -> dict:
    """load + resolve in a fresh interpreter (huggingface_hub reads its environment at import)."""
    code = ("import json, sys; from rlsys.config import load_config; "
            "from rlsys.system.model_source import resolve_model_paths; "
            "print(json.dumps(resolve_model_paths(load_config(sys.argv[1])).model.model_dump()))")
    result = subprocess.run([sys.executable, "-c", code, str(config_path)], capture_output=True, text=True,
                            timeout=120, check=True)
    return json.loads(result.stdout)


def test_a_hub_id_resolves_to_its_cached_snapshot_pinned_to_the_commit(hub_cache, tmp_path):
    model = _resolved(write_config(tmp_path / "c.yaml", Path("x"), model={"path": "tiny-org/tiny-qwen"}))
    assert model["path"] == str(hub_cache / "models--tiny-org--tiny-qwen" / "snapshots" / COMMIT)
    assert (model["hub_id"], model["revision"]) == ("tiny-org/tiny-qwen", COMMIT)
    assert (Path(model["path"]) / "config.json").is_file()


def test_a_revision_picks_its_branch(hub_cache, tmp_path):
    model = _resolved(write_config(tmp_path / "c.yaml", Path("x"),
                                   model={"path": "tiny-org/tiny-qwen", "revision": "v2"}))
    assert model["revision"] == OTHER and model["path"].endswith(OTHER)


def test_a_local_directory_is_left_alone(hub_cache, tmp_path, tiny_model_dir):
    model = _resolved(write_config(tmp_path / "c.yaml", tiny_model_dir))
    assert model["path"] == str(tiny_model_dir) and model["hub_id"] is None


def test_rlsys_plan_reads_the_shapes_of_a_hub_model(hub_cache, tmp_path):
    config = write_config(tmp_path / "c.yaml", Path("x"), model={"path": "tiny-org/tiny-qwen"})
    result = subprocess.run([sys.executable, "-m", "rlsys.cli", "plan", str(config), "--json"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["fits"] is True


def test_a_hub_id_in_no_cache_while_offline_is_refused_naming_the_cache(hub_cache, tmp_path):
    config = write_config(tmp_path / "c.yaml", Path("x"), model={"path": "tiny-org/not-downloaded"})
    error = refused_by_cli("plan", str(config), new_process=True)
    assert "tiny-org/not-downloaded" in error and "HF_HUB_OFFLINE" in error and str(hub_cache) in error


def test_an_unknown_revision_offline_is_refused(hub_cache, tmp_path):
    config = write_config(tmp_path / "c.yaml", Path("x"), model={"path": "tiny-org/tiny-qwen", "revision": "v9"})
    error = refused_by_cli("plan", str(config), new_process=True)
    assert "revision v9" in error and "no hub cache" in error


def test_a_revision_beside_a_local_directory_is_refused(tiny_model_dir, tmp_path):
    config = write_config(tmp_path / "c.yaml", tiny_model_dir, model={"path": str(tiny_model_dir), "revision": "v2"})
    assert "remove model.revision" in refused_by_cli("plan", str(config))


def test_a_node_whose_cache_lacks_the_snapshot_or_sits_elsewhere_is_named(hub_cache, tmp_path, monkeypatch):
    """A node resolves the driver's commit in its own cache: missing there (offline), or at another
    path than the driver's, is a problem the node check reports."""
    import rlsys.system.model_source as source

    driver_path = str(tmp_path / "driver-cache" / "snapshots" / COMMIT)
    elsewhere = tmp_path / "node-cache" / "snapshots" / COMMIT
    monkeypatch.setattr(source, "snapshot_of", lambda repo_id, revision, option="model.path": elsewhere)
    problem = _model_problem((driver_path,), (HubSnapshot("tiny-org/tiny-qwen", COMMIT, driver_path),))
    assert "same hub cache path" in problem and str(elsewhere) in problem

    def missing(repo_id, revision, option="model.path"):
        raise source.ConfigError("in no hub cache")

    monkeypatch.setattr(source, "snapshot_of", missing)
    problem = _model_problem((driver_path,), (HubSnapshot("tiny-org/tiny-qwen", COMMIT, driver_path),))
    assert "not in this node's hub cache" in problem

