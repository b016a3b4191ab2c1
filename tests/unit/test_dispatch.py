"""Dealing requests to engines: least outstanding work, runs of prompts, the weight-update gate."""

import asyncio

import pytest

from rlsys.rollout.dispatch import Dispatcher, LoopThread
from rlsys.rollout.manager import split_into_chunks


@pytest.mark.parametrize("prompts,engines", [(7, 1), (7, 2), (32, 2), (3, 4), (1, 3)])
def test_runs_cover_every_prompt_once_in_order(prompts, engines):
    chunks = split_into_chunks(prompts, engines)
    assert [p for chunk in chunks for p in chunk] == list(range(prompts))
    assert len(chunks) == (1 if engines == 1 else min(prompts, 4 * engines))


def test_a_slow_engine_gets_fewer_requests_than_a_fast_one():
    """Two engines, at most 2 requests in flight each; engine 1 does not answer until everything
    else is done. Pulling work by least outstanding gives it only the 2 it took first and engine 0
    the other 38 (round-robin would have dealt each 20 and waited on the slow one). No wall-clock
    timing: the slow engine is an event."""
    async def main():
        dispatcher = Dispatcher(2)
        slow_engine_may_answer = asyncio.Event()
        answered = 0

        async def request():
            nonlocal answered
            async with dispatcher.engine(1, limit=2) as index:
                if index == 1:
                    await slow_engine_may_answer.wait()
                else:
                    await asyncio.sleep(0)
                answered += 1
                if answered == 38:
                    slow_engine_may_answer.set()

        await asyncio.wait_for(asyncio.gather(*(request() for _ in range(40))), timeout=30)
        return dispatcher.served

    assert asyncio.run(main()) == [38, 2]


def test_without_a_limit_each_request_goes_to_the_least_loaded_engine():
    async def main():
        dispatcher = Dispatcher(3)
        held = []
        for _ in range(6):
            context = dispatcher.engine(1)
            held.append((context, await context.__aenter__()))
        loads = list(dispatcher.outstanding)
        for context, _ in held:
            await context.__aexit__(None, None, None)
        return [index for _, index in held], loads, dispatcher.outstanding

    order, loads, after = asyncio.run(main())
    assert order == [0, 1, 2, 0, 1, 2]
    assert loads == [2, 2, 2] and after == [0, 0, 0]


def test_closing_the_gate_waits_for_requests_in_flight_and_holds_new_ones():
    async def main():
        dispatcher, events = Dispatcher(1), []

        async def request(name, seconds):
            async with dispatcher.engine():
                events.append(f"{name} start")
                await asyncio.sleep(seconds)
                events.append(f"{name} end")

        first = asyncio.create_task(request("a", 0.05))
        await asyncio.sleep(0.01)
        await dispatcher.close_gate()  # returns only once "a" has ended
        events.append("gate closed")
        second = asyncio.create_task(request("b", 0.0))
        await asyncio.sleep(0.02)
        events.append("update done")
        await dispatcher.open_gate()
        await asyncio.gather(first, second)
        return events

    assert asyncio.run(main()) == ["a start", "a end", "gate closed", "update done", "b start", "b end"]


def test_loop_thread_runs_coroutines_submitted_from_another_thread():
    loop = LoopThread()
    try:
        async def add(a, b):
            await asyncio.sleep(0)
            return a + b
        assert loop.submit(add(2, 3)).result(timeout=5) == 5
    finally:
        loop.close()


def test_calls_made_together_travel_as_one_request_and_each_gets_its_own_answer():
    from rlsys.records import SamplingParams
    from rlsys.rollout.dispatch import RequestBatcher

    sent = []

    async def send(index, prompts, params, seeds):
        sent.append((index, [list(p) for p in prompts], params.max_new_tokens, seeds))
        if prompts[0] == [666]:
            raise RuntimeError("engine down")
        return [f"answer to {p}" for p in prompts]

    async def main():
        batcher = RequestBatcher(send)
        short, long = SamplingParams(max_new_tokens=1), SamplingParams(max_new_tokens=4)
        answers = await asyncio.gather(
            batcher.generate(0, [1], short, 11), batcher.generate(0, [2], short), batcher.generate(1, [3], short),
            batcher.generate(0, [4], long), batcher.generate(2, [666], short), return_exceptions=True)
        later = await batcher.generate(0, [5], short)
        return answers, later, batcher.requests_sent

    answers, later, requests = asyncio.run(main())
    assert answers[:4] == ["answer to [1]", "answer to [2]", "answer to [3]", "answer to [4]"]
    assert isinstance(answers[4], RuntimeError)
    assert later == "answer to [5]"
    # same engine and parameters together, each call with its own seed; another engine or other parameters apart
    assert sorted(sent, key=repr) == sorted([(0, [[1], [2]], 1, [11, None]), (1, [[3]], 1, [None]), (0, [[4]], 4, [None]),
                                             (2, [[666]], 1, [None]), (0, [[5]], 1, [None])], key=repr)
    assert requests == 5
