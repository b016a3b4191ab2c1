"""`RolloutManager`: generation over the engines (their lives: `EngineFleet`, rollout/fleet.py),
requests dealt to the least busy engine and issued again when one dies."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import traceback
from collections.abc import Callable, Coroutine
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ray.exceptions import RayActorError, RayTaskError

from rlsys.errors import RunFailed
from rlsys.records import EncodedPrompt, Generation, SamplingParams
from rlsys.rollout.dispatch import Dispatcher, LoopThread, RequestBatcher
from rlsys.rollout.fleet import EngineCallFailed, EngineEvents, EngineFleet, is_engine_death
from rlsys.rollout.partial import GroupInFlight, continuation, settle, stitch
from rlsys.rollout.seeds import call_seed, sample_seeds
from rlsys.rollout.sglang.server import ServerSpec
from rlsys.rollout.standing import StandingRecord
from rlsys.rollout.trajectory import (
    GenerateFunction,
    RolloutContext,
    TokenIdOutOfVocabulary,
    check_token_ids,
    run_generate_function,
)

logger = logging.getLogger(__name__)


def split_into_chunks(num_prompts: int, num_engines: int) -> list[range]:
    """Contiguous runs of prompts, one request each: the whole batch for one engine; four per
    engine otherwise, so a fast engine can take more of them than a slow one."""
    count = 1 if num_engines == 1 else min(num_prompts, 4 * num_engines)
    bounds = [round(i * num_prompts / count) for i in range(count + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(count) if bounds[i] < bounds[i + 1]]


class GenerateFunctionError(RunFailed):
    """rollout.generate_function raised something other than a ToolError: a bug to fix, not a
    sample to skip."""


class PoisonRequest(RunFailed):
    """A request was in flight when an engine died, and again when the fresh engine started after
    that death died too: the request, not the engine, is taken to be the cause. It is not sent
    again, so one bad request cannot use up rollout.engine.max_restarts."""


def model_vocab_size(model_path: str) -> int:
    """Rows of the model's token embedding (config.json's vocab_size; the tokenizer may have more
    or fewer tokens): the ids an engine can be sent."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if not isinstance(size, int) or size < 1:
        raise RunFailed(f"model.path {model_path}: config.json has no vocab_size (nor text_config.vocab_size)")
    return size


class RolloutManager:
    """Generation over an engine fleet (`fleet`, rollout/fleet.py: the engines' lives): samples,
    partial-rollout groups and multi-turn trajectories, each request dealt to the least busy
    engine; a request whose engine died is issued again once the fleet has restarted it."""

    def __init__(self, fleet: EngineFleet, vocab_size: int):
        self.fleet = fleet
        self.vocab_size = vocab_size  # the token ids an engine can be sent (model_vocab_size)
        self._loop = LoopThread()
        self.dispatcher = Dispatcher(len(fleet.engines))
        self.batcher = RequestBatcher(self._send)

    @classmethod
    def start(cls, spec: ServerSpec, num_engines: int, log_dir: str, actor_options: list[dict],
              standing: StandingRecord | None = None, hangs_dir: str | None = None,
              events: EngineEvents | None = None) -> RolloutManager:
        """Engines started (or a standing set's found: `EngineFleet`) and generation over them."""
        vocab_size = model_vocab_size(spec.model.path)
        return cls(EngineFleet(spec, num_engines, log_dir, actor_options, standing, hangs_dir, events), vocab_size)

    def shutdown(self) -> None:
        """The fleet stopped (a standing set's left ready), then the request loop."""
        self.fleet.shutdown()
        self._loop.close()

    async def _send(self, index: int, prompts: list[list[int]], sampling: SamplingParams,
                    seeds: list[int | None]) -> list[Generation]:
        return await self.fleet.engines[index].generate.remote(prompts, sampling, 1, None, seeds)



    def generate(self, prompts: list[list[int]], sampling: SamplingParams, n: int,
                 recover: bool = True, images: list[tuple[bytes, ...]] | None = None,
                 seeds: list[int | None] | None = None) -> list[Generation]:
        """n samples per prompt, grouped prompt by prompt in the caller's order. Runs of prompts
        go to the least busy engine; a run whose engine dies is issued again once the engine has
        been restarted (with `recover`; otherwise the EngineCallFailed is raised). `images`: per
        prompt, a vision-language model's (rollout/engine.py `generate`). `seeds`: per prompt, the
        seed its samples' seeds derive from (rollout/seeds.py; None: the engines draw)."""
        sample_seeds_of = [sample_seeds(seed, n) for seed in (seeds or [None] * len(prompts))]
        for number, prompt in enumerate(prompts):
            self._refuse_out_of_vocabulary(prompt, f"prompt {number} of the batch")
        chunks = split_into_chunks(len(prompts), len(self.fleet.engines))
        # Two runs in flight per engine: its server batches them, and the rest wait for whichever
        # engine frees up first.
        limit = 2 * n * max(len(chunk) for chunk in chunks) if len(self.fleet.engines) > 1 else None
        answers: dict[int, list[Generation]] = {}
        self._answer_all(
            list(range(len(chunks))),
            lambda keys: _gather([self._generate_run([prompts[p] for p in chunks[c]], sampling, n, limit,
                                                     None if images is None else [images[p] for p in chunks[c]],
                                                     [seed for p in chunks[c] for seed in sample_seeds_of[p]])
                                  for c in keys]),
            answers.__setitem__,
            lambda c: (f"prompts {chunks[c].start}..{chunks[c].stop - 1} of the batch (the first's token ids begin "
                       f"{prompts[chunks[c].start][:16]})"),
            recover)
        return [generation for c in range(len(chunks)) for generation in answers[c]]

    async def _generate_run(self, prompts: list[list[int]], sampling: SamplingParams, n: int,
                            limit: int | None, images: list[tuple[bytes, ...]] | None = None,
                            seeds: list[int | None] | None = None) -> list[Generation] | EngineCallFailed:
        async with self.dispatcher.engine(len(prompts) * n, limit) as index:
            try:
                return await self.fleet.engines[index].generate.remote(prompts, sampling, n, images, seeds)
            except (RayActorError, RayTaskError) as error:
                return EngineCallFailed(index, error)

    def generate_groups(self, groups: list[GroupInFlight], needed: int, sampling: SamplingParams,
                        recover: bool = True) -> int:
        """Partial rollouts: generate (or continue) the unfinished samples of `groups`, one request
        per group, all at once, until at least `needed` groups are finished; then abort what is
        still running on the engines, whose samples keep the tokens they have (finish reason
        "abort"). The groups are updated in place. A group whose engine died is sent again, as it
        stood before, once the engine has been restarted (with `recover`). Returns the samples aborted."""
        for group in groups:
            self._refuse_out_of_vocabulary(group.prompt.token_ids, f"prompt {group.prompt.text!r}")
        aborted = 0

        def unfinished() -> list[int]:  # none once `needed` groups are finished
            if sum(group.finished for group in groups) >= needed:
                return []
            return [i for i, group in enumerate(groups) if not group.finished]

        async def round_of(pending: list[int]) -> list:
            nonlocal aborted
            results, round_aborted = await self._groups_round(groups, pending, needed, sampling)
            aborted += round_aborted
            return results

        def take(i: int, result) -> None:  # the group itself holds the answers
            if isinstance(result, BaseException):
                raise result

        self._answer_all(unfinished(), round_of, take, lambda i: f"the group of prompt {groups[i].prompt.text!r}",
                         recover, next_keys=unfinished)
        return aborted

    def _refuse_out_of_vocabulary_trajectory(self, generation: Generation, what: str) -> None:
        """A generate function's trajectory holds only ids the model has rows for: one that never went
        to an engine (appended after the last call) would fail the trainer's embedding instead."""
        for part, token_ids in (("prompt_ids", generation.prompt_ids), ("response_ids", generation.response_ids)):
            try:
                check_token_ids(token_ids, self.vocab_size)
            except TokenIdOutOfVocabulary as error:
                raise GenerateFunctionError(
                    f"{what} whose {part} hold token id {error.token_id} at position {error.position} of "
                    f"{len(token_ids)}, outside the model's vocabulary (ids 0..{self.vocab_size - 1}: config.json "
                    "vocab_size); build token ids with the model's tokenizer (ctx.encode, ctx.append(text))"
                ) from None

    def _refuse_out_of_vocabulary(self, token_ids: list[int], where: str) -> None:
        try:
            check_token_ids(token_ids, self.vocab_size)
        except TokenIdOutOfVocabulary as error:
            raise RunFailed(f"{where}: {error}; the tokenizer (model.tokenizer_path) does not match the model "
                            "(model.path)") from None

    async def _groups_round(self, groups: list[GroupInFlight], pending: list[int], needed: int,
                            sampling: SamplingParams) -> tuple[list, int]:
        """One round of `generate_groups`: every pending group in flight; once `needed` groups are
        finished, abort_all on every engine (again every half second, for a request that reached
        its server after the abort) until every request has answered."""
        finished, aborted = sum(group.finished for group in groups), 0
        enough = asyncio.Event()
        aborting = False

        async def one(i: int):
            nonlocal finished, aborted
            group = groups[i]
            seeds = sample_seeds(group.prompt.seed, len(group.samples))  # a continuation keeps its sample's seed
            positions, inputs, params = [], [], []
            for k in group.unfinished():
                if group.samples[k] is not None:  # (a checkpoint's samples from before `settle`)
                    group.samples[k] = settle(group.samples[k], sampling)
                    if not group.samples[k].aborted:
                        continue
                step_input, step_sampling = continuation(group.prompt.token_ids, group.samples[k], sampling)
                positions.append(k)
                inputs.append(step_input)
                params.append(step_sampling)
            if positions:
                async with self.dispatcher.engine(len(positions)) as index:
                    try:
                        answers = await self.fleet.engines[index].generate_each.remote(inputs, params,
                                                                                 [seeds[k] for k in positions])
                    except (RayActorError, RayTaskError) as error:
                        return EngineCallFailed(index, error)
                refused = next((a for a in answers if a.aborted and not aborting), None)
                if refused is not None:  # the engine aborted it by itself (e.g. longer than its context)
                    raise RunFailed(f"engine-{index} aborted a sample of prompt {group.prompt.text!r} before any "
                                    f"abort was sent: {refused.stop_reason or 'no reason given'}")
                for k, answer in zip(positions, answers, strict=True):
                    group.samples[k] = settle(stitch(group.prompt.token_ids, group.samples[k], answer), sampling)
                    aborted += group.samples[k].aborted
            if group.finished:
                finished += 1
                if finished >= needed:
                    enough.set()
            return None

        if finished >= needed:
            enough.set()
        requests = asyncio.gather(*(one(i) for i in pending), return_exceptions=True)
        enough_waiter = asyncio.ensure_future(enough.wait())
        await asyncio.wait([requests, enough_waiter], return_when=asyncio.FIRST_COMPLETED)
        enough_waiter.cancel()
        while not requests.done():
            aborting = True
            await _gather([_answer(engine.abort_all.remote()) for engine in self.fleet.engines])  # a dead one: ignored
            await asyncio.wait([requests], timeout=0.5)
        return requests.result(), aborted

    def trajectories(self, prompts: list[EncodedPrompt], function: GenerateFunction, sampling: SamplingParams,
                     n: int, tokenizer, tool_timeout_s: float, recover: bool = True,
                     function_path: str = "") -> list[Generation]:
        """n trajectories per prompt from `function` (rollout.generate_function, imported from
        `function_path`), all running at once; every engine call goes to the engine with the fewest
        requests outstanding. A trajectory whose engine died runs again from its start once the
        engine is back. Token ids outside the model's vocabulary never reach an engine."""
        name = f"rollout.generate_function {function_path!r}" if function_path else "rollout.generate_function"
        samples = [prompt for prompt in prompts for _ in range(n)]
        answers: dict[int, Generation] = {}

        def take(i: int, result) -> None:
            if isinstance(result, TokenIdOutOfVocabulary):
                raise GenerateFunctionError(
                    f"{name} sent the engine input_ids it cannot take, on prompt {samples[i].text!r}"
                    f"{_user_code_line(result)}: {result}. The request was not sent (an engine given such an "
                    "id crashes); build token ids with the model's tokenizer (ctx.encode, ctx.append(text))"
                ) from None
            if isinstance(result, BaseException):
                raise GenerateFunctionError(
                    f"{name} raised on prompt {samples[i].text!r}:\n"
                    + "".join(traceback.format_exception(result))[-3000:]
                ) from result
            self._refuse_out_of_vocabulary_trajectory(result, f"{name} returned a trajectory of prompt "
                                                      f"{samples[i].text!r}")
            answers[i] = result

        self._answer_all(
            list(range(len(samples))),
            lambda keys: _gather([self._trajectory(samples[i], function, sampling, tokenizer, tool_timeout_s,
                                                   sample_seeds(samples[i].seed, n)[i % n])
                                  for i in keys]),
            take, lambda i: f"a trajectory of prompt {samples[i].text!r}", recover)
        return [answers[i] for i in range(len(samples))]

    async def _trajectory(self, prompt: EncodedPrompt, function: GenerateFunction, sampling: SamplingParams,
                          tokenizer, tool_timeout_s: float, seed: int | None = None) -> Generation | EngineCallFailed:
        calls = itertools.count()  # the trajectory's engine calls, each with its own seed (run again: the same)

        async def engine_call(input_ids: list[int], params: SamplingParams) -> Generation:
            check_token_ids(input_ids, self.vocab_size)
            call = call_seed(seed, next(calls))
            async with self.dispatcher.engine() as index:
                try:
                    return await self.batcher.generate(index, input_ids, params, call)
                except (RayActorError, RayTaskError) as error:
                    raise EngineCallFailed(index, error) from error

        try:
            return await run_generate_function(function, RolloutContext(prompt, engine_call, tokenizer, sampling,
                                                                        tool_timeout_s))
        except EngineCallFailed as failure:
            return failure

    def _answer_all(self, keys: list[int], round_of: Callable[[list[int]], Coroutine[Any, Any, list]],
                    take: Callable[[int, Any], None], describe: Callable[[int], str], recover: bool,
                    next_keys: Callable[[], list[int]] | None = None) -> None:
        """The one retry loop of `generate`, `generate_groups` and `trajectories`: `round_of(keys)`
        issues the requests of `keys` at once and answers one result per key. A key whose engine
        died (EngineCallFailed) is issued again in the next round, once its engine is restarted
        (with `recover`; else the failure is raised), unless it was in flight at that engine's
        previous death too (PoisonRequest); every other result goes to `take(key, result)`, which
        may raise. The next round's keys: `next_keys()`, or those that failed; none ends the loop."""
        died_with: dict[int, int] = {}
        while keys:
            results = self._loop.submit(round_of(keys)).result()
            failed: dict[int, EngineCallFailed] = {}
            for key, result in zip(keys, results, strict=True):
                if isinstance(result, EngineCallFailed):
                    failed[key] = result
                else:
                    take(key, result)
            self._refuse_poison_requests(failed, died_with, describe)
            self._recover_all(failed.values(), recover)
            keys = next_keys() if next_keys is not None else list(failed)

    def _refuse_poison_requests(self, failed: dict[int, EngineCallFailed], died_with: dict[int, int],
                                describe: Callable[[int], str]) -> None:
        """PoisonRequest when a request in `failed` killed an engine started after an earlier
        engine death it was in flight at (`died_with`: request -> self.fleet.restarts at that death);
        otherwise note the requests in flight at this death."""
        deaths = {key: failure for key, failure in failed.items() if is_engine_death(failure.error)}
        repeated = [key for key, failure in deaths.items()
                    if key in died_with and self.fleet.launched_after[failure.index] > died_with[key]]
        if repeated:
            failure = deaths[repeated[0]]
            others = f" (and {len(repeated) - 1} more requests in flight both times)" if len(repeated) > 1 else ""
            cause = getattr(failure.error, "cause", None) or failure.error
            raise PoisonRequest(
                f"engine-{failure.index} died again just after its restart, with {describe(repeated[0])}{others} "
                "in flight both times: that request, not the engine, is taken to be the cause, and it is not sent "
                f"again (restarts used: {self.fleet.restarts} of {self.fleet.max_restarts}). The engine's error:\n"
                f"{type(cause).__name__}: {cause}"
            ) from failure.error
        died_with.update({key: self.fleet.restarts for key in deaths})

    def _recover_all(self, failures, recover: bool) -> None:
        """Restart each engine that died (once, after every request has ended: a restart re-syncs
        weights into all engines)."""
        by_engine = {failure.index: failure for failure in failures}
        for index, failure in by_engine.items():
            if not recover or not is_engine_death(failure.error):
                raise failure.error
            self.fleet.recover(index, failure.error)

    @contextmanager
    def weights_updating(self):
        """No request is in flight or starts inside the block (the engines' weights change)."""
        self._loop.submit(self.dispatcher.close_gate()).result()
        try:
            yield
        finally:
            self._loop.submit(self.dispatcher.open_gate()).result()























def _user_code_line(error: BaseException) -> str:
    """` at file.py:12 (`code`)`: the innermost frame of `error` outside this package (the
    generate function's line that made the engine call), or ""."""
    package = str(Path(__file__).resolve().parent)
    frames = [frame for frame in traceback.extract_tb(error.__traceback__)
              if not str(Path(frame.filename).resolve()).startswith(package)]
    if not frames:
        return ""
    frame = frames[-1]
    return f" at {frame.filename}:{frame.lineno} (`{frame.line}`)"


async def _answer(ref):
    return await ref


async def _gather(calls: list) -> list:
    """Every call's result or exception, in order."""
    return await asyncio.gather(*calls, return_exceptions=True)
