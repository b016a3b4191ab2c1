"""Bounded staleness (rollout.max_staleness = N): the batches of the next N steps generate while
the trainer trains, never from weights more than N versions behind; batches still ahead at a stop
are dropped with their prompts drawn again; a dead engine drops them all. The engines and the
trainer are stand-ins here (the real ones: tests/e2e/test_pipeline.py); the pipeline, the
sampler and the staleness filter are the run's own."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace

import pytest

from rlsys.algorithms.samples import ScoredBatch
from rlsys.algorithms.shaping import drop_stale_groups
from rlsys.data.datasets import PromptSampler
from rlsys.records import EncodedPrompt, Generation, PromptRecord, Sample
from rlsys.rollout.manager import EngineCallFailed
from rlsys.run import batches
from rlsys.run.batches import BatchesAhead, StepBatch

GROUP = 2


class Engines:
    """Weight versions as the engines hold them: the trainer pushes one per step."""

    def __init__(self):
        self.version = 0
        self.lock = threading.Lock()
        self.fail_step: int | None = None


def _fake_collect(engines: Engines, per_step_s: float):
    def collect(run, sampling, step, recover=True):
        start = (run.sampler.epoch, run.sampler.index)
        prompts = run.sampler.next_batch()
        time.sleep(per_step_s)  # generating
        if step == engines.fail_step:
            from ray.exceptions import RayActorError

            raise EngineCallFailed(0, RayActorError())
        with engines.lock:
            version = engines.version
        samples = [Sample(p, Generation([1], [2], [0.0], "stop", version), "x") for p in prompts for _ in range(GROUP)]
        return StepBatch(ScoredBatch(samples=samples), [s.generation for s in samples], {"step": step}, start,
                         (run.sampler.epoch, run.sampler.index))
    return collect


def _run(total_steps: int) -> SimpleNamespace:
    @contextmanager
    def phase(row, state, timing):
        yield

    records = [EncodedPrompt(PromptRecord(f"p{i}", "l"), [i]) for i in range(10)]
    config = SimpleNamespace(trainer=SimpleNamespace(total_steps=total_steps),
                             rollout=SimpleNamespace(n_samples_per_prompt=GROUP))
    return SimpleNamespace(config=config, sampler=PromptSampler(records, 2, seed=0), phase=phase)


def _train(run, ahead: BatchesAhead, engines: Engines, steps: int, slow_trainer: bool = True) -> list[StepBatch]:
    """The coordinator's order of calls: take (or generate in the loop), put the next ones ahead,
    train, push the next version. A slow trainer pushes its version only once the batches ahead
    are generated (the order a trainer slower than the engines makes, without timing)."""
    trained = []
    for step in range(steps):
        batch = ahead.take({}, step, trainer_version=step)
        ahead.before_training(step, time.perf_counter())
        if slow_trainer:
            concurrent.futures.wait(list(ahead._pending))
        with engines.lock:
            engines.version = step + 1
        trained.append(batch)
    return trained


@pytest.mark.parametrize("steps_ahead", [1, 2, 3])
def test_a_slow_trainer_trains_batches_up_to_n_versions_old_and_no_older(monkeypatch, steps_ahead):
    engines = Engines()
    monkeypatch.setattr(batches, "collect_step_batch", _fake_collect(engines, per_step_s=0.005))
    run = _run(total_steps=12)
    ahead = BatchesAhead(run, None, steps_ahead)
    trained = _train(run, ahead, engines, steps=12)
    ahead.close()
    ages = [step - b.scored.samples[0].generation.weight_version for step, b in enumerate(trained)]
    assert all(0 <= age <= steps_ahead for age in ages), ages
    assert ages[steps_ahead + 1:] == [steps_ahead] * (12 - steps_ahead - 1)  # the queue is full: N behind
    assert all(b.metrics.get("stale_dropped_samples", 0) == 0 for b in trained)
    # the prompts advance one batch a step, none skipped or drawn twice: as one sampler draws them
    reference = _run(total_steps=12).sampler
    expected = []
    for _ in range(12):
        expected.append((reference.epoch, reference.index))
        reference.next_batch()
    assert [b.start for b in trained] == expected


def test_batches_ahead_at_a_stop_are_dropped_and_their_prompts_drawn_again(monkeypatch):
    engines = Engines()
    monkeypatch.setattr(batches, "collect_step_batch", _fake_collect(engines, per_step_s=0.005))
    run = _run(total_steps=20)
    ahead = BatchesAhead(run, None, 3)
    trained = _train(run, ahead, engines, steps=4)
    ahead.close()  # three batches were ahead (steps 4..6): dropped
    assert (run.sampler.epoch, run.sampler.index) == trained[-1].end == (0, 8)


def test_a_dead_engine_drops_every_batch_ahead_and_the_loop_generates_again(monkeypatch):
    engines = Engines()
    engines.fail_step = 3
    monkeypatch.setattr(batches, "collect_step_batch", _fake_collect(engines, per_step_s=0.005))
    run = _run(total_steps=20)
    ahead = BatchesAhead(run, None, 2)
    first = _train(run, ahead, engines, steps=3)  # steps 3 and 4 are ahead; 3's engine dies
    engines.fail_step = None
    again = ahead.take({}, 3, trainer_version=3)  # generated in the loop's thread, which restarts the engine
    assert again.start == first[-1].end  # step 4's prompts too are drawn again, after step 3's
    assert again.end == (run.sampler.epoch, run.sampler.index) == (0, first[-1].end[1] + 2)
    ahead.close()


def _samples(versions: list[int]) -> list[Sample]:
    return [Sample(PromptRecord("p", "l"), Generation([1], [2], [0.0], "stop", v), "x") for v in versions]


def test_a_group_with_a_sample_older_than_n_versions_is_dropped_whole():
    samples = _samples([5, 5, 3, 5, 4, 4])  # groups of 2: (5, 5), (3, 5), (4, 4)
    kept, dropped = drop_stale_groups(samples, 2, trainer_version=6, max_staleness=2)
    assert [s.generation.weight_version for s in kept] == [5, 5, 4, 4] and dropped == 2
    assert drop_stale_groups(samples, 2, trainer_version=5, max_staleness=2) == (samples, 0)


def test_staleness_that_cannot_overlap_or_is_negative_is_refused_before_anything_starts(tmp_path, tiny_model_dir):
    from rlsys.config import ConfigError, load_config
    from tests.helpers import write_config

    path = write_config(tmp_path / "c.yaml", tiny_model_dir)
    with pytest.raises(ConfigError, match="rollout.max_staleness=2 overlaps generation with training, which needs "
                                          "engines and trainers on their own devices: set placement.mode=disaggregated"):
        load_config(path, ["rollout.max_staleness=2", "placement.mode=colocated"])
    with pytest.raises(ConfigError, match="rollout.max_staleness: Input should be greater than or equal to 0"):
        load_config(path, ["rollout.max_staleness=-1", "placement.mode=disaggregated"])
    assert load_config(path, ["rollout.max_staleness=3", "placement.mode=disaggregated"]).rollout.max_staleness == 3
