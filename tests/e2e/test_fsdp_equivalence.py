"""2 FSDP2 ranks train exactly like one rank (which trains the model whole in fp32, without FSDP),
up to what fp32 can promise.

Why the bounds are what they are:
- A gradient element is a sum of per-token terms; the two sides add them in different orders
  (different micro-batch shapes, a reduce-scatter over 2 ranks). For n terms, fp32 (unit roundoff
  u = 6e-8) promises |difference| <= 2 n u sum|terms|. The longest sums here have a few hundred
  terms, so 1e-4 of the gradient's scale is a safe bound. A real sharding bug (a sequence lost or
  counted twice, a wrong normaliser or world-size factor) moves gradients by >= 1/#sequences ~ 8%.
- Adam normalises: its step is lr * m / (sqrt(v) + eps), so an element whose exact gradient is ~0
  (e.g. k_proj.bias: softmax ignores a constant shift of every key score) takes a step of up to lr
  in a direction set by rounding noise. Parameters after N Adam steps therefore differ by up to
  2 lr per step and element whatever the arithmetic; comparing them after several steps against a
  fixed 1e-5 failed on another machine of this kind. So the trajectory test starts every step from
  identical states (the sharded DCP checkpoint loaded into the single process: this also proves a
  2-rank checkpoint restores into one process) and checks Adam's own promise on the parameters.
"""

from dataclasses import replace

import pytest
import torch

from rlsys.actors.inspectable_group import InspectableTrainerGroup
from rlsys.records import TrainSequence
from tests.helpers import random_sequences, trainer_spec

pytestmark = pytest.mark.second_stream  # trainer ranks, no engine set: on the second stream's cluster (Makefile: test)

GRADIENT_RTOL = 1e-4  # of the gradient's scale (max |g| over the model); see the module docstring
METRIC_ATOL = 1e-4  # token means of O(1) values, from states equal up to Adam's noise steps


def _sequences(seed: int, count: int, vocab: int) -> list[TrainSequence]:
    return random_sequences(seed, count, prompt_lens=(2, 6), response_lens=(1, 5), vocab=vocab)


@pytest.fixture(scope="module")
def trainers(trainer_pool, tiny_model_dir, request):
    # Several packed micro-batches per rank (a 24-token budget), two optimizer steps per batch (so
    # the second mini-batch is off-policy and clipping acts), KL to the reference and entropy on.
    spec = trainer_spec(
        tiny_model_dir, lr=1e-3, max_tokens_per_microbatch=24, mini_batches_per_step=2,
        use_kl_loss=True, kl_coef=0.1, entropy_coef=0.01, clip_eps_low=0.01, clip_eps_high=0.01,
    )
    failed_before = request.session.testsfailed
    sharded, single = trainer_pool.take((spec, 2), (spec, 1))
    yield sharded, single, spec
    trainer_pool.give_back([sharded, single], healthy=request.session.testsfailed == failed_before)


def _copy_state(source: InspectableTrainerGroup, target: InspectableTrainerGroup, directory) -> None:
    """Model, optimizer, scheduler and RNG of `source` into `target`, through a DCP checkpoint."""
    directory.mkdir()
    source.save_checkpoint(str(directory))
    target.load_checkpoint(str(directory))


def test_two_fsdp_ranks_train_step_by_step_like_one_process(trainers, tmp_path):
    sharded, single, spec = trainers
    for step in range(3):
        _copy_state(sharded, single, tmp_path / f"step{step}")
        before = single.full_state_dict()
        assert all(torch.equal(before[k], v) for k, v in sharded.full_state_dict().items())
        batch = _sequences(step, count=13, vocab=80)
        a, b = sharded.train_step(batch), single.train_step(batch)
        for metric in ("loss", "kl", "entropy", "grad_norm"):
            assert a[metric] == pytest.approx(b[metric], abs=METRIC_ATOL), f"step {step}: {metric}"
        assert a["clip_fraction"] == pytest.approx(b["clip_fraction"], abs=1.0 / a["train_tokens"])
        assert a["train_tokens"] == b["train_tokens"] and a["lr"] == b["lr"]
        params_a, params_b = sharded.full_state_dict(), single.full_state_dict()
        # Adam's promise: each optimizer step moves an element by at most ~lr, so two runs from
        # the same state differ by at most 2 lr per step, whatever the rounding.
        adam_bound = 2 * spec.trainer.lr * spec.trainer.mini_batches_per_step
        worst = max((params_a[k] - params_b[k]).abs().max().item() for k in params_a)
        assert worst <= adam_bound, f"step {step}: parameters differ by {worst} > {adam_bound}"
        moved = max((params_a[k] - before[k]).abs().max().item() for k in params_a)
        assert moved > spec.trainer.lr / 2  # the step really changed the weights
    assert a["kl"] > 0 and a["clip_fraction"] > 0  # the policy moved, so both terms were exercised


def test_two_fsdp_ranks_compute_the_gradient_of_one_process(trainers, tmp_path):
    sharded, single, _ = trainers
    sharded.train_step(_sequences(100, count=13, vocab=80))  # away from the reference: KL acts
    _copy_state(sharded, single, tmp_path / "moved")
    batch = _sequences(101, count=13, vocab=80)
    grads_a, grads_b = sharded.loss_gradients(batch), single.loss_gradients(batch)
    assert grads_a.keys() == grads_b.keys()
    scale = max(g.abs().max().item() for g in grads_b.values())
    assert scale > 1e-3  # a real gradient, not an all-zero one that would match trivially
    worst_name = max(grads_a, key=lambda k: (grads_a[k] - grads_b[k]).abs().max().item())
    worst = (grads_a[worst_name] - grads_b[worst_name]).abs().max().item()
    assert worst <= GRADIENT_RTOL * scale, f"{worst_name}: gradients differ by {worst} (scale {scale})"


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_every_loss_aggregation_gives_the_gradient_of_one_process(trainers, tmp_path, mode):
    """The mode lives in the driver-side InspectableTrainerGroup: it turns each global mini-batch into token
    weights, so the ranks' split (over 2 ranks and 24-token micro-batches here) cannot change it."""
    sharded, single, spec = trainers
    _copy_state(sharded, single, tmp_path / "state")
    batch = _sequences(102, count=13, vocab=80)
    batch[3].loss_mask = [0] * batch[3].response_len  # e.g. a truncated response under mask_truncated
    batch[8].loss_mask = [1] + [0] * (batch[8].response_len - 1)
    token_mean = single.loss_gradients(batch)
    algorithm = spec.algorithm.model_copy(update={"loss_agg_mode": mode, "loss_norm_tokens": 8})
    try:
        for group in (sharded, single):
            group.spec = replace(group.spec, algorithm=algorithm)
        grads_a, grads_b = sharded.loss_gradients(batch), single.loss_gradients(batch)
    finally:
        for group in (sharded, single):
            group.spec = replace(group.spec, algorithm=spec.algorithm)
    scale = max(g.abs().max().item() for g in grads_b.values())
    worst = max((grads_a[k] - grads_b[k]).abs().max().item() for k in grads_a)
    assert worst <= GRADIENT_RTOL * scale, f"{mode}: gradients differ by {worst} (scale {scale})"
    # and the mode changed the gradient (by far more than rounding), so the comparison means something
    assert max((grads_b[k] - token_mean[k]).abs().max().item() for k in grads_b) > 0.01 * scale


def test_one_fp32_rank_trains_the_model_whole_and_two_ranks_shard_it(trainers):
    sharded, single, _ = trainers
    assert single.describe()["layout"] == "whole model"
    assert sharded.describe()["layout"] == "FSDP2"
