"""A trainer call's bound (trainer.call_timeout_s, actors/group.py `TrainerGroup._wait`): ranks that
do not answer in time are named and the hang hook runs first; a rank that fails is its own error at
once, not a hang, even while the others wait (as they would for it in a collective)."""

import time
from types import SimpleNamespace

import pytest
import ray

from rlsys.actors.group import TrainerGroup, TrainerHang

pytestmark = pytest.mark.second_stream  # trainer ranks, no engine set: on the second stream's cluster (Makefile: test)


@ray.remote(num_cpus=0)
class Rank:
    def answer(self, seconds: float, fail: bool = False) -> str:
        if fail:
            raise ValueError("this rank's own error")
        time.sleep(seconds)
        return "done"


def _started(count: int) -> list:
    """`count` ranks whose processes are up (starting one takes seconds on a loaded machine: not a hang)."""
    ranks = [Rank.remote() for _ in range(count)]
    ray.get([rank.answer.remote(0) for rank in ranks])
    return ranks


def _group(timeout_s):
    group = TrainerGroup.__new__(TrainerGroup)  # the bound's logic alone: no model, no process group
    group.spec = SimpleNamespace(trainer=SimpleNamespace(call_timeout_s=timeout_s))
    group.events, group.hung, group.workers = None, False, []
    return group


def test_ranks_past_the_bound_are_named_after_the_hang_hook_ran(ray_cluster):
    ranks = _started(3)
    group = _group(2.0)  # a started rank answers `answer(0)` in milliseconds
    seen = []
    group.events = SimpleNamespace(trainer_hung=lambda what, stuck: seen.append((what, stuck)) or "rank 2 stopped")
    with pytest.raises(TrainerHang) as caught:
        group._wait([ranks[0].answer.remote(0), ranks[1].answer.remote(60), ranks[2].answer.remote(60)], "train_step")
    assert seen == [("train_step", [1, 2])] and caught.value.ranks == [1, 2] and group.hung
    assert str(caught.value) == ("trainer rank(s) 1, 2 did not finish train_step within 2 s (trainer.call_timeout_s): "
                                 "rank 2 stopped")
    for rank in ranks:
        ray.kill(rank)


def test_a_failed_rank_is_its_own_error_not_a_hang(ray_cluster):
    ranks = _started(2)
    group = _group(600.0)
    group.events = SimpleNamespace(trainer_hung=lambda what, stuck: pytest.fail("a failure is not a hang"))
    with pytest.raises(ray.exceptions.RayTaskError, match="this rank's own error"):
        group._wait([ranks[0].answer.remote(600), ranks[1].answer.remote(0, fail=True)], "train_step")
    assert not group.hung
    assert _group(None)._wait([ranks[1].answer.remote(0)], "sleep") == ["done"]  # no bound: as ray.get
    for rank in ranks:
        ray.kill(rank)
