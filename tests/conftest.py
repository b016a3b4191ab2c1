"""Shared fixtures: a tiny local model, and one Ray cluster reused by the integration tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from rlsys.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster for the tests that drive actors; shut down (with its workers) at the end."""
    import ray

    from rlsys.cluster import ACTOR_ENV

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": ACTOR_ENV})
    yield
    ray.shutdown()


def write_config(path: Path, model_dir: Path, **sections) -> Path:
    """A small valid config file; keyword arguments replace whole sections."""
    import yaml

    tree = {
        "model": {"path": str(model_dir)},
        "data": {"synthetic": {"task": "max_digit", "num_train": 200, "num_eval": 20}},
        "rollout": {"n_samples_per_prompt": 4, "max_new_tokens": 2,
                    "engine": {"skip_tokenizer_init": True, "context_length": 64}},
        "trainer": {"num_ranks": 2, "total_steps": 2},
    }
    tree.update(sections)
    path.write_text(yaml.safe_dump(tree))
    return path


def pytest_collection_modifyitems(config, items):
    """`gpu`-marked tests run only where CUDA is available (they are skipped on the CPU machines)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
