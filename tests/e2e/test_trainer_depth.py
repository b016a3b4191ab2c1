"""Trainer depth: sleep/wake_up, packing, micro-batch invariance, KL, checkpoints and resume."""


import pytest
import torch

from rlsys.actors.inspectable_group import InspectableTrainerGroup
from rlsys.records import TrainSequence
from tests.helpers import random_sequences, trainer_spec

pytestmark = pytest.mark.second_stream  # trainer ranks, no engine set: on the second stream's cluster (Makefile: test)


def _batch(seed: int, count: int = 12) -> list[TrainSequence]:
    return random_sequences(seed, count)


def _identical(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _spec(model_dir, **overrides):
    return trainer_spec(model_dir, lr=1e-3, **overrides)


@pytest.mark.parametrize("ranks", [1, 2], ids=["whole model", "FSDP2"])
def test_training_after_sleep_and_wake_up_is_bit_identical(warm_trainer_groups, tiny_model_dir, ranks):
    plain, cycled = warm_trainer_groups((_spec(tiny_model_dir), ranks), (_spec(tiny_model_dir), ranks))
    for step in range(3):
        plain.train_step(_batch(step))
        cycled.train_step(_batch(step))
        slept = cycled.sleep()
        assert slept["bytes"] > 0
        assert cycled.wake_up()["bytes"] == slept["bytes"]
    assert _identical(plain.full_state_dict(), cycled.full_state_dict())


def test_a_rebuilt_group_trains_bit_for_bit_as_a_new_one(warm_trainer_groups, tiny_model_dir):
    """What the warm groups of these tests (tests/trainer_pool.py) and the trainer ranks a standing set
    keeps between runs (actors/warm_ranks.py) rest on: a group rebuilt for a spec (`respec`, then
    `build`) after training another (a reference, optimizer state, left asleep) trains as one started for it."""
    used, = warm_trainer_groups((_spec(tiny_model_dir, use_kl_loss=True, kl_coef=0.1, warmup_steps=3), 2))
    used.train_step(_batch(0))
    used.sleep()
    used.rebuild(_spec(tiny_model_dir))
    new = InspectableTrainerGroup(_spec(tiny_model_dir), 2)
    try:
        for step in range(2):
            metrics = [group.train_step(_batch(step)) for group in (used, new)]
            for row in metrics:
                assert row.pop("trainer_compute_s") > 0  # (a time)
            assert metrics[0] == metrics[1]
        assert _identical(used.full_state_dict(), new.full_state_dict())
    finally:
        new.shutdown()


def test_a_kept_rank_whose_run_was_killed_releases_itself(warm_trainer_groups, tiny_model_dir):
    """A standing set's kept rank watches the driver of the run that holds it (`TrainerWorker.serve`):
    while it lives the rank keeps what it built; once it is killed (no `release` from it) the rank
    drops its model, optimizer and transport by itself, and builds the next spec as before."""
    import subprocess
    import time

    import psutil
    import ray

    from rlsys.actors.trainer import HOLDER_POLL_S
    from rlsys.system.process_start import start_key

    group, = warm_trainer_groups((_spec(tiny_model_dir), 1))
    rank = group.workers[0]
    driver = subprocess.Popen(["sleep", "600"])  # stands for the run's driver on this node
    try:
        ray.get(rank.serve.remote(driver.pid, start_key(psutil.Process(driver.pid))))
        time.sleep(3 * HOLDER_POLL_S)
        assert ray.get(rank.built.remote())  # its run lives
    finally:
        driver.kill()
        driver.wait()
    deadline = time.monotonic() + 60
    while ray.get(rank.built.remote()) and time.monotonic() < deadline:  # waits, never a measure
        time.sleep(0.2)
    assert not ray.get(rank.built.remote())
    group.rebuild(_spec(tiny_model_dir))
    assert group.train_step(_batch(0))["grad_norm"] > 0


def test_a_kept_rank_whose_run_was_killed_after_its_set_was_stopped_exits(ray_cluster, tiny_model_dir):
    """`rlsys engines down --force` leaves the ranks a run uses to that run, which stops them when it
    fails; should its driver be killed instead, nobody is left to stop them. The rank that sees its
    driver gone and its set (`set_name`) gone too exits (a rank of its own: its death is the subject)."""
    import subprocess
    import time

    import psutil
    import ray

    from rlsys.actors.trainer import HOLDER_POLL_S
    from rlsys.system.process_start import start_key

    group = InspectableTrainerGroup(_spec(tiny_model_dir), 1)
    try:
        rank = group.workers[0]
        process = psutil.Process(ray.get(rank.process.remote())[0])  # is_running: this process, not a reused pid
        driver = subprocess.Popen(["sleep", "600"])  # stands for the run's driver on this node
        ray.get(rank.serve.remote(driver.pid, start_key(psutil.Process(driver.pid)), "a-set-that-is-gone"))
        time.sleep(3 * HOLDER_POLL_S)
        assert process.is_running()  # its run lives
        driver.kill()
        driver.wait()

        def exited() -> bool:
            try:
                return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return True

        deadline = time.monotonic() + 60
        while not exited() and time.monotonic() < deadline:
            time.sleep(0.2)  # waits, never a measure
        assert exited()
    finally:
        group.shutdown()


@pytest.fixture(scope="module")
def medium_model_dir(tmp_path_factory):
    from rlsys.tools.tiny_model import TinyModelSpec, make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("medium"), TinyModelSpec(hidden_size=256, num_layers=4))


def test_twenty_sleep_cycles_do_not_leak_host_memory(ray_cluster, medium_model_dir):
    # ranks of its own (not the warm ones): what it measures is their processes' memory
    group = InspectableTrainerGroup(_spec(medium_model_dir), 2)
    try:
        group.train_step(_batch(0))  # optimizer state exists from here on
        moved = group.sleep()["bytes"]
        group.wake_up()
        baseline = group.host_memory_bytes()
        for _ in range(19):
            group.sleep()
            group.wake_up()
        growth = max(after - before for after, before in zip(group.host_memory_bytes(), baseline, strict=True))
        per_rank_state = moved / 2
        assert growth < 0.5 * per_rank_state, f"RSS grew {growth} bytes over 19 cycles of {per_rank_state} bytes"
    finally:
        group.shutdown()


def test_packed_logprobs_equal_unpacked_per_sequence(warm_trainer_groups, tiny_model_dir):
    packed, one_by_one = warm_trainer_groups((_spec(tiny_model_dir, packing=True, max_tokens_per_microbatch=64), 2),
                                             (_spec(tiny_model_dir, packing=False, micro_batch_size=1), 1))
    batch = _batch(7, count=15)
    a, b = packed.compute_log_probs(batch), one_by_one.compute_log_probs(batch)
    assert [len(x) for x in a] == [s.response_len for s in batch]
    worst = max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))
    assert worst < 1e-5


def test_one_or_four_micro_batches_give_the_same_gradient(warm_trainer_groups, tiny_model_dir):
    batch = _batch(3, count=16)
    tokens = sum(len(s.token_ids) for s in batch)
    whole, quarters, padded = warm_trainer_groups(
        (_spec(tiny_model_dir, max_tokens_per_microbatch=tokens), 1),
        (_spec(tiny_model_dir, max_tokens_per_microbatch=tokens // 4 + 1), 1),
        (_spec(tiny_model_dir, packing=False, micro_batch_size=4), 1))
    g1, g4, gp = whole.loss_gradients(batch), quarters.loss_gradients(batch), padded.loss_gradients(batch)
    for name in g1:
        assert torch.allclose(g1[name], g4[name], atol=1e-6, rtol=1e-5), name
        assert torch.allclose(g1[name], gp[name], atol=1e-6, rtol=1e-5), name
    assert max(g.abs().max().item() for g in g1.values()) > 1e-4  # a real gradient


def test_kl_is_zero_at_start_and_positive_once_the_policy_moves(warm_trainer_groups, tiny_model_dir):
    group, = warm_trainer_groups((_spec(tiny_model_dir, use_kl_loss=True, kl_coef=0.1, kl_estimator="k3"), 2))
    first = group.train_step(_batch(0))
    assert first["kl"] == 0.0
    second = group.train_step(_batch(1))
    assert second["kl"] > 0.0
    assert all(kl > 0 for kl in group.compute_sequence_kl(_batch(2)))


@pytest.mark.parametrize("ranks", [1, 2], ids=["whole model", "FSDP2"])
def test_trainer_resumed_from_checkpoint_continues_identically(warm_trainer_groups, tiny_model_dir, tmp_path, ranks):
    spec = _spec(tiny_model_dir, lr_schedule="cosine", warmup_steps=2, total_steps=4,
                 mini_batches_per_step=2)
    # Three groups of the same spec, made at once; `resumed` has no state until it loads the
    # checkpoint, written after it was made by a group killed before it loads it.
    straight, first_half, resumed = warm_trainer_groups((spec, ranks), (spec, ranks), (spec, ranks))
    for step in range(4):
        straight_last = straight.train_step(_batch(step))
    for step in range(2):
        first_half.train_step(_batch(step))
    first_half.save_checkpoint(str(tmp_path))
    first_half.shutdown()  # the ranks are killed; only the checkpoint survives
    resumed.load_checkpoint(str(tmp_path))
    for step in range(2, 4):
        last = resumed.train_step(_batch(step))
    assert _identical(straight.full_state_dict(), resumed.full_state_dict())
    assert last["lr"] == straight_last["lr"] < spec.trainer.lr  # the cosine schedule was restored too


def test_gradient_checkpointing_and_lr_warmup_behave(warm_trainer_groups, tiny_model_dir):
    batch = _batch(5)
    plain, checkpointed = warm_trainer_groups((_spec(tiny_model_dir, warmup_steps=4), 1),
                                              (_spec(tiny_model_dir, gradient_checkpointing=True), 1))
    g_plain, g_ckpt = plain.loss_gradients(batch), checkpointed.loss_gradients(batch)
    for name in g_plain:
        assert torch.allclose(g_plain[name], g_ckpt[name], atol=1e-6, rtol=1e-5), name
    # linear warmup over 4 optimizer steps: lr after each step is lr * min(step + 1, 4) / 4
    lrs = [plain.train_step(_batch(s))["lr"] for s in range(5)]
    assert lrs == pytest.approx([5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
