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
def ray_cluster() -> str:
    """A local Ray cluster for the tests that drive actors, and for `rlsys train` runs that join it
    (`ray_address`); shut down (with its workers) at the end. Yields its address. Its logical CPUs
    are more than any one test's placement asks for (a run's actors and a test's own at once)."""
    import ray

    from rlsys.system.cluster import ACTOR_ENV

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=12, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": ACTOR_ENV})
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="session")
def ray_address(ray_cluster) -> str:
    """`placement.ray_address=...`: a `rlsys train` run joins the session's cluster, as a job submitted
    to a running cluster does, instead of starting (and stopping) a local one: a one-step run took
    24-25 s joined against 32 s with its own cluster on a 2-core machine. Only for runs whose test
    does not look at what a run leaves behind or kill its driver: a joined run does not wait for
    its workers to exit, so those keep a cluster of their own, as a local run has."""
    return f"placement.ray_address={ray_cluster}"


@pytest.fixture
def leftovers(monkeypatch):
    """A Leftovers check (tests/helpers.py) started now: after the session's fixtures (a function
    fixture comes after them), with its mark in the environment of everything the test starts."""
    import uuid

    from tests.helpers import LEFTOVERS_MARK, Leftovers

    mark = uuid.uuid4().hex
    monkeypatch.setenv(LEFTOVERS_MARK, mark)
    return Leftovers(mark)


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
