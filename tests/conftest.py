"""Shared fixtures: a tiny local model, and one Ray cluster reused by the integration tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def rlsys_console_output():
    """What the CLI sets up (rlsys.observability.logs), for tests calling rlsys in-process: the
    "rlsys: ..." lines on stdout (warnings, errors on stderr), where capsys reads them."""
    from rlsys.observability.logs import configure_logging

    configure_logging()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from rlsys.tools.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster for the tests that drive actors; shut down (with its workers) at the end."""
    import ray

    from rlsys.system.cluster import ACTOR_ENV

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": ACTOR_ENV})
    yield
    ray.shutdown()


def pytest_collection_modifyitems(config, items):
    """`gpu`-marked tests run only where CUDA is available (they are skipped on the CPU machines)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MB tmpfs mounted at tmp_path/"disk" (a disk that fills up), unmounted at the end; needs
    root, as the machines that run the tests give."""
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=True)
