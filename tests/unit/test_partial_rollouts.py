"""Partial rollouts (rollout.mode partial): a step takes the groups finished first, aborts the
rest and continues them at the next step; no prompt is trained twice or lost, across a checkpoint
too; every token keeps the version that sampled it. The run's own RolloutManager.generate_groups
and PartialRollouts drive stand-in engines here: each makes one token per tick, the same tokens
for the same prompt and position whatever the weights, and answers an abort with what it has (as
SGLang's abort_all does: tests/e2e/test_partial_rollouts.py runs the real engines)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest
from ray.exceptions import RayActorError

from rlsys.config import RunConfig
from rlsys.data.datasets import PromptSampler
from rlsys.errors import RunFailed
from rlsys.records import EncodedPrompt, Generation, PromptRecord, SamplingParams
from rlsys.rollout.fleet import EngineFleet
from rlsys.rollout.manager import RolloutManager
from rlsys.rollout.partial import GroupInFlight, continuation, settle, stitch
from rlsys.run.rollout_modes import runner_for
from rlsys.run.rollout_modes.partial import PartialRollouts

GROUP, WANTED, OVERSAMPLE, MAX_NEW = 2, 4, 3, 40
SAMPLING = SamplingParams(max_new_tokens=MAX_NEW)


def target_length(prompt_id: int, sample_seed: int) -> int:
    """Long-tailed: most responses 2-3 tokens, one prompt in five 30 (the step's slowest)."""
    return 30 if prompt_id % 5 == 0 else 2 + sample_seed % 2


def token(prompt_id: int, position: int) -> int:
    return 100 + (prompt_id * 7 + position) % 50


class Remote:
    def __init__(self, function):
        self.function = function

    def remote(self, *args):
        return self.function(*args)


class StandInEngine:
    """Tokens by `token`, logprob -(version + 1) per token (so a token tells which weights made it)."""

    def __init__(self, world: dict, aborts_by_itself: bool = False):
        self.world, self.aborts_by_itself = world, aborts_by_itself
        self.dead = False
        self.generate_each = Remote(self._generate_each)
        self.abort_all = Remote(self._abort_all)

    async def _abort_all(self):
        self.world["aborts"] += 1

    async def _generate_each(self, inputs: list[list[int]], params: list[SamplingParams],
                             seeds: list[int | None]) -> list[Generation]:
        if self.dead:
            raise RayActorError()
        aborts_at_start, version = self.world["aborts"], self.world["version"]
        self.world["requests"] += 1
        self.world["seeds"] += [(ids[0], len(ids) - 1, seed) for ids, seed in zip(inputs, seeds, strict=True)]
        answers = []
        for ids, sampling in zip(inputs, params, strict=True):
            prompt_id, done = ids[0], len(ids) - 1  # the prompt is one token; the rest were made before
            want = target_length(prompt_id, self.world["requests"] + len(answers))
            answers.append([prompt_id, done, min(want, done + sampling.max_new_tokens), []])
        while any(done + len(new) < end for _, done, end, new in answers):
            await asyncio.sleep(0.001)
            if self.aborts_by_itself:
                return [Generation(ids, [], [], "abort", version, stop_reason="Input is longer than the context")
                        for ids in inputs]
            if self.world["aborts"] != aborts_at_start:
                break
            for prompt_id, done, end, new in answers:
                if done + len(new) < end:
                    new.append(token(prompt_id, done + len(new)))
        return [Generation(ids, new, [-(version + 1.0)] * len(new),
                           "abort" if done + len(new) < end else ("stop" if end - done < sampling.max_new_tokens
                                                                   else "length"), version)
                for ids, sampling, (prompt_id, done, end, new) in zip(inputs, params, answers, strict=True)]


def _manager(engines: list[StandInEngine]) -> RolloutManager:
    """The run's RolloutManager around stand-in engines (no Ray actors behind it)."""
    fleet = object.__new__(EngineFleet)  # its engines' lives are not this test's: no actors, no restart of its own
    fleet.engines, fleet.max_restarts, fleet.restarts, fleet.launched_after = engines, 2, 0, [0] * len(engines)
    fleet.addresses, fleet.events, fleet.standing = [], None, None
    return RolloutManager(fleet, vocab_size=1000)


def _partials(max_age: int | None = None) -> PartialRollouts:
    config = RunConfig.model_validate({
        "model": {"path": "unused"}, "data": {"synthetic": {"task": "max_digit"}, "prompts_per_step": WANTED},
        "placement": {"mode": "disaggregated"},
        "rollout": {"n_samples_per_prompt": GROUP, "max_new_tokens": MAX_NEW,
                    "mode": {"type": "partial", "oversample": OVERSAMPLE, "max_age": max_age}},
    })
    rounds = runner_for(config.rollout.mode).rounds(config, maker=None)  # the partial mode's own rounds
    assert isinstance(rounds, PartialRollouts)
    return rounds


def _sampler() -> PromptSampler:
    return PromptSampler([EncodedPrompt(PromptRecord(f"p{i}", "l"), [i]) for i in range(1, 60)], WANTED, seed=0)


def _steps(partials, manager, sampler, world, first: int, last: int) -> list[tuple[list, dict]]:
    """Steps first..last-1 as the coordinator runs them; after each, the engines take a new version."""
    trained = []
    for step in range(first, last):
        world["version"] = step
        partials.begin_step(trainer_version=step)
        prompts, generations = partials.round(manager, sampler, SAMPLING, WANTED, recover=True)
        trained.append(([p.token_ids[0] for p in prompts], generations, partials.step_metrics(generations, step)))
    return trained


def _check_samples(trained):
    for prompts, generations, _ in trained:
        assert len(prompts) == WANTED and len(generations) == WANTED * GROUP
        for k, generation in enumerate(generations):
            prompt_id = prompts[k // GROUP]
            # whatever aborts it went through, the response is the one the engine would have made in one go
            assert generation.response_ids == [token(prompt_id, j) for j in range(len(generation.response_ids))]
            assert generation.finish_reason == "stop"
            assert len(generation.response_ids) in (2, 3, 30)
            # each token's log-prob is the one of the weights its token_versions entry names
            assert generation.logprobs == [-(v + 1.0) for v in generation.token_versions]
            assert generation.weight_version == min(generation.token_versions)


def _world():
    return {"version": 0, "aborts": 0, "requests": 0, "seeds": []}  # seeds: (prompt id, tokens before, seed)


def test_a_step_trains_the_groups_finished_first_and_carries_the_rest_with_their_tokens():
    world = _world()
    manager, partials, sampler = _manager([StandInEngine(world), StandInEngine(world)]), _partials(), _sampler()
    trained = _steps(partials, manager, sampler, world, 0, 12)
    _check_samples(trained)
    # every prompt drawn is trained exactly once or still in flight
    ids = [p for prompts, _, _ in trained for p in prompts]
    carried = [g.prompt.token_ids[0] for g in partials.groups]
    assert len(ids) == len(set(ids)) and not set(ids) & set(carried)
    assert sorted(ids + carried) == sorted(r.token_ids[0] for r in _sampler().next_prompts(sampler.index))
    assert len(partials.groups) == WANTED + OVERSAMPLE - WANTED  # in flight, topped up each step
    # long responses were aborted and continued with later weights: tokens of two versions and more
    continued = [g for _, generations, _ in trained for g in generations if len(set(g.token_versions)) > 1]
    assert continued
    metrics = [m for _, _, m in trained]
    assert max(m["partial_age_max"] for m in metrics) >= 1 and all(m["partial_age_mean"] >= 0 for m in metrics)
    assert sum(m["aborted_samples"] for m in metrics) > 0 and sum(m["partial_samples_continued"] for m in metrics) > 0
    assert all(m["partial_tokens_discarded"] == 0 for m in metrics)  # no age bound: nothing is thrown away
    assert [m["partial_groups_carried_in"] for m in metrics] == [0] + [OVERSAMPLE] * 11
    # each sample has its own seed (rollout/seeds.py), and a continuation keeps the one it started with
    starts = {(prompt_id, seed) for prompt_id, before, seed in world["seeds"] if before == 0}
    assert all(seed is not None for _, _, seed in world["seeds"])
    assert {(prompt_id, seed) for prompt_id, before, seed in world["seeds"] if before > 0} <= starts
    for prompt_id in set(ids):
        assert len({seed for p, seed in starts if p == prompt_id}) == GROUP


def test_the_groups_in_flight_survive_a_checkpoint_and_no_prompt_is_trained_twice_or_lost():
    world = _world()
    manager, partials, sampler = _manager([StandInEngine(world)]), _partials(), _sampler()
    before = _steps(partials, manager, sampler, world, 0, 5)
    saved = json.loads(json.dumps(partials.saved()))  # as coordinator.json holds them
    position = (sampler.epoch, sampler.index)

    resumed, resumed_sampler = _partials(), _sampler()
    resumed.restore(saved)
    resumed_sampler.restore(*position)
    assert [g.prompt.token_ids for g in resumed.groups] == [g.prompt.token_ids for g in partials.groups]
    assert [g.prompt.seed for g in resumed.groups] == [g.prompt.seed for g in partials.groups]
    assert all(g.prompt.seed is not None for g in resumed.groups)  # the samples' seeds travel with their groups
    assert [[s and s.response_ids for s in g.samples] for g in resumed.groups] == \
        [[s and s.response_ids for s in g.samples] for g in partials.groups]
    after = _steps(resumed, manager, resumed_sampler, world, 5, 10)
    _check_samples(before + after)
    ids = [p for prompts, _, _ in before + after for p in prompts]
    carried = [g.prompt.token_ids[0] for g in resumed.groups]
    assert len(ids) == len(set(ids)) and not set(ids) & set(carried)
    assert sorted(ids + carried) == sorted(r.token_ids[0] for r in _sampler().next_prompts(resumed_sampler.index))


def test_an_age_bound_restarts_older_samples_and_counts_their_tokens():
    world = _world()
    manager, partials, sampler = _manager([StandInEngine(world)]), _partials(max_age=1), _sampler()
    trained = _steps(partials, manager, sampler, world, 0, 12)
    _check_samples(trained)
    for step, (_, generations, metrics) in enumerate(trained):
        assert all(step - g.weight_version <= 1 for g in generations)
        assert metrics["partial_age_max"] <= 1
    assert sum(m["partial_tokens_discarded"] for _, _, m in trained) > 0


def test_a_group_whose_engine_died_is_sent_again_as_it_stood_once_the_engine_is_back(monkeypatch):
    world = _world()
    engines = [StandInEngine(world), StandInEngine(world)]
    manager, partials, sampler = _manager(engines), _partials(), _sampler()
    restarted = []

    def restart(index, reason):
        restarted.append(index)
        engines[index].dead = False
        manager.fleet.restarts += 1
        manager.fleet.launched_after[index] = manager.fleet.restarts

    monkeypatch.setattr(manager.fleet, "restart", restart)
    first = _steps(partials, manager, sampler, world, 0, 3)
    engines[1].dead = True
    later = _steps(partials, manager, sampler, world, 3, 8)
    assert restarted == [1]
    _check_samples(first + later)
    ids = [p for prompts, _, _ in first + later for p in prompts]
    assert len(ids) == len(set(ids))


def test_an_engine_that_aborts_a_request_by_itself_fails_the_step_with_its_reason():
    world = _world()
    manager, partials, sampler = _manager([StandInEngine(world, aborts_by_itself=True)]), _partials(), _sampler()
    partials.begin_step(0)
    with pytest.raises(RunFailed, match="before any abort was sent: Input is longer than the context"):
        partials.round(manager, sampler, SAMPLING, WANTED, recover=True)


def test_a_continuation_asks_only_for_the_tokens_left_and_stitches_versions_per_token():
    prompt = [1, 2]
    first = Generation(prompt, [7, 8, 9], [-0.1, -0.2, -0.3], "abort", 3)
    ids, params = continuation(prompt, first, SamplingParams(max_new_tokens=5, min_new_tokens=4))
    assert ids == [1, 2, 7, 8, 9] and params.max_new_tokens == 2 and params.min_new_tokens == 1
    whole = stitch(prompt, first, Generation(ids, [10], [-0.4], "stop", 5))
    assert whole.prompt_ids == prompt and whole.response_ids == [7, 8, 9, 10]
    assert whole.token_versions == [3, 3, 3, 5] and whole.weight_version == 3 and whole.finish_reason == "stop"
    group = GroupInFlight.new(EncodedPrompt(PromptRecord("p", "l"), prompt), 2)
    group.samples = [whole, first]
    assert group.unfinished() == [1] and group.oldest_version() == 3
    assert group.restart_older_than(4) == 7 and group.samples == [None, None]


def test_an_abort_landing_on_a_responses_last_token_ends_it_instead_of_continuing_past_its_end():
    """SGLang answers "abort" for a request whose last token (a stop token, or the max_new_tokens-th)
    was sampled in the step the abort landed in. Such a sample is ended, never continued."""
    prompt, sampling = [1, 2], SamplingParams(max_new_tokens=4, stop_token_ids=[0, 9])
    ended_on_stop = Generation(prompt, [7, 9], [-0.1, -0.2], "abort", 3, stop_reason="Aborted")
    assert settle(ended_on_stop, sampling) == replace(ended_on_stop, finish_reason="stop", stop_reason=None)
    full = Generation(prompt, [7, 8, 8, 8], [-0.1] * 4, "abort", 3)
    assert settle(full, sampling).finish_reason == "length"
    part_way = Generation(prompt, [7, 8], [-0.1] * 2, "abort", 3)
    assert settle(part_way, sampling) is part_way  # tokens left and no stop token: continued later
    assert settle(ended_on_stop, replace(sampling, ignore_eos=True)).aborted  # the engine ignores stops then

    class AbortsOnTheLastToken:
        """Prompt 4's sample ends at once; the others are answered when the abort comes, each with
        finish reason "abort": prompt 1's ending on a stop token, prompt 2's at max_new_tokens,
        prompt 3's part-way."""

        def __init__(self):
            self.calls: list[list[list[int]]] = []
            self.generate_each, self.abort_all = Remote(self._generate_each), Remote(self._abort_all)
            self.aborted = asyncio.Event()

        async def _abort_all(self):
            self.aborted.set()

        async def _generate_each(self, inputs, params, seeds):
            self.calls.append(inputs)
            if inputs[0][0] == 4:
                return [Generation(ids, [5, 0], [-0.1] * 2, "stop", 3) for ids in inputs]
            if len(inputs[0]) > 1:  # the continuation of prompt 3
                return [Generation(ids, [0], [-0.5], "stop", 4) for ids in inputs]
            await self.aborted.wait()
            tokens = {1: [7, 9], 2: [7, 8, 8, 8], 3: [7, 8]}
            return [Generation(ids, tokens[ids[0]], [-0.1] * len(tokens[ids[0]]), "abort", 3) for ids in inputs]

    engine = AbortsOnTheLastToken()
    manager = _manager([engine])
    groups = [GroupInFlight.new(EncodedPrompt(PromptRecord(f"p{i}", "l"), [i]), 1) for i in (1, 2, 3, 4)]
    try:
        assert manager.generate_groups(groups, needed=1, sampling=sampling) == 1  # only prompt 3's stays aborted
        assert [group.finished for group in groups] == [True, True, False, True]
        manager.generate_groups(groups, needed=4, sampling=sampling)
    finally:
        manager._loop.close()
    assert engine.calls[4:] == [[[3, 7, 8]]]  # the ended ones were never sent again
    assert [(g.samples[0].response_ids, g.samples[0].finish_reason) for g in groups] == [
        ([7, 9], "stop"), ([7, 8, 8, 8], "length"), ([7, 8, 0], "stop"), ([5, 0], "stop")]


def test_partial_rollouts_are_refused_with_what_they_cannot_combine_with():
    base = {"model": {"path": "unused"}, "data": {"synthetic": {"task": "max_digit"}},
            "placement": {"mode": "disaggregated"}}
    for rollout, message in [
        ({"mode": "partial", "generate_function": "x.py:f"}, "rollout.mode partial cannot build samples with "
         "rollout.generate_function .it aborts requests and continues them from their token ids"),
        ({"partial_rollouts": True, "max_staleness": 2}, "choose one"),  # the keys of earlier versions
        ({"oversample": 2}, "rollout.oversample applies to partial rollouts only"),
        ({"partial_max_age": 2}, "rollout.partial_max_age applies to partial rollouts only"),
        ({"partial_rollouts": True, "mode": "partial"}, "rollout.partial_rollouts and rollout.mode are both set"),
    ]:
        with pytest.raises(ValueError, match=message):
            RunConfig.model_validate({**base, "rollout": rollout})
