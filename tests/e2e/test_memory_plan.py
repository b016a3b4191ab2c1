"""`rlsys plan` against what it plans for: a measured train step on this CPU, and the session's Ray
cluster it is given. (The terms as hand sums from config.json shapes: tests/unit/test_memory_plan.py.)"""

import pytest

from rlsys.config import ConfigError, RunConfig
from rlsys.model.shape import GiB, ModelShape
from rlsys.plan.memory_plan import memory_plan, plan_memory
from tests.unit.test_memory_plan import _config


def test_a_measured_train_step_matches_the_plan_and_chunked_log_probs_cut_its_peak(tmp_path):
    """One rank, a tiny Qwen2 with Qwen's 151,936-token vocabulary, 2,048 tokens in one micro-batch,
    each variant in a fresh process (the rise of peak RSS over the resident model; on CPU the host
    is the device): the default chunked log-probs peak at most 0.35x the unchunked full-vocabulary
    path, and the plan's train phase (minus the weights already resident) is within 30% of it."""
    from bench.memory import train_step_peaks

    peaks = train_step_peaks(tmp_path)
    assert peaks["train_step_peak_over_unchunked"] <= 0.35, peaks
    model_dir = tmp_path / "vocab152k"
    config = RunConfig.model_validate({
        "model": {"path": str(model_dir)}, "data": {"synthetic": {"task": "max_digit"}},
        "trainer": {"num_ranks": 1, "max_tokens_per_microbatch": 2048, "offload_between_steps": True},
        "rollout": {"num_engines": 1}})
    plan = plan_memory(config, ModelShape.from_model_dir(model_dir), 24 * GiB, on_gpu=False, flash_attention=False)
    planned = plan.phases["train"] - plan.terms["trainer_params"]
    measured = peaks["train_step_peak_rise_bytes_chunked"]
    assert 0.7 * measured <= planned <= 1.3 * measured, (planned, measured, plan.terms)


def test_plan_asks_the_ray_cluster_it_is_given(ray_cluster, tiny_model_dir):
    """The session's cluster has no GPUs: a CPU plan, saying so; placement.device=cuda is refused."""
    plan = memory_plan(_config(tiny_model_dir, placement={"ray_address": ray_cluster}))
    assert plan.device.startswith("CPUs: the Ray cluster has no GPUs")
    with pytest.raises(ConfigError, match="the Ray cluster has no GPUs"):
        memory_plan(_config(tiny_model_dir, placement={"ray_address": ray_cluster, "device": "cuda"}))
