"""Multi-turn trajectories: what a generate function builds, how the loss sees it, tools that
fail. (The calculator example learning on a real engine is in tests/e2e/test_tool_use.py.)"""

import asyncio
import time

import pytest
import torch

from rlsys.actors.batching import build_micro_batch
from rlsys.algorithms.losses import micro_batch_loss
from rlsys.algorithms.samples import generation_text, reward_call, to_train_sequences
from rlsys.config import AlgorithmConfig
from rlsys.records import EncodedPrompt, Generation, PromptRecord, Sample, SamplingParams
from rlsys.rollout.trajectory import (
    Completion,
    RolloutContext,
    Trajectory,
    run_generate_function,
    single_turn,
)
from rlsys.run.generation import trajectory_metrics
from rlsys.tools.tiny_parts import build_tokenizer


def hand_built_trajectory() -> Trajectory:
    """prompt (3) | policy (2) | tool output (3) | policy (1)"""
    trajectory = Trajectory(prompt_ids=[3, 4, 5])
    trajectory.add_generated(Completion([7, 8], [-1.0, -2.0], "stop", 4))
    trajectory.add_injected([9, 10, 11])
    trajectory.add_generated(Completion([12], [-0.5], "stop", 5))
    return trajectory


def test_a_trajectory_records_who_produced_each_token():
    generation = hand_built_trajectory().to_generation()
    assert generation.response_ids == [7, 8, 9, 10, 11, 12]
    assert generation.loss_mask == [1, 1, 0, 0, 0, 1]
    assert generation.logprobs == [-1.0, -2.0, 0.0, 0.0, 0.0, -0.5]
    assert generation.turns == 2 and generation.weight_version == 4  # the oldest weights it used
    assert trajectory_metrics([generation]) == {"turns_mean": 2.0, "tool_calls_mean": 0.0, "tool_errors": 0,
                                                "policy_tokens_fraction": 0.5}
    with pytest.raises(ValueError, match="log-probs"):
        Trajectory([1]).add_generated(Completion([2, 3], [-1.0], "stop", 0))


@pytest.mark.parametrize("packed", [True, False])
def test_injected_tokens_get_exactly_zero_gradient_from_every_loss_term(packed):
    """Policy loss with clipping and TIS, KL loss and the entropy bonus: the gradient of the
    micro-batch objective w.r.t. the log-prob and entropy at each tool-output position is
    exactly 0, and not at the policy's positions."""
    plain = Generation([1, 2], [7, 7], [-1.5, -1.0], "stop", 5)
    samples = [Sample(PromptRecord("p", "l"), hand_built_trajectory().to_generation(), "", advantage=0.7),
               Sample(PromptRecord("p", "l"), plain, "", advantage=-0.4)]
    sequences = to_train_sequences(samples)
    assert sequences[0].loss_mask == [1, 1, 0, 0, 0, 1] and sequences[1].loss_mask is None
    batch = build_micro_batch(sequences, [0, 1], pad_id=0, device=torch.device("cpu"), packed=packed)
    generator = torch.Generator().manual_seed(0)
    shape = batch.targets.shape
    logprobs = (-torch.rand(shape, generator=generator) - 0.1).requires_grad_()
    entropy = torch.rand(shape, generator=generator).requires_grad_()
    batch.old_logprobs = logprobs.detach() + 0.3 * torch.randn(shape, generator=generator)  # ratios != 1, some clip
    batch.ref_logprobs = logprobs.detach() - torch.rand(shape, generator=generator)
    algorithm = AlgorithmConfig(use_kl_loss=True, kl_coef=0.1, entropy_coef=0.01,
                                corrections=[{"name": "importance_sampling", "max": 1.5}])
    loss = micro_batch_loss(logprobs, entropy, batch, algorithm)
    loss.objective.backward()

    row, first, _ = batch.spans[0]  # position first + t predicts response token t
    injected = [(row, first + t) for t in (2, 3, 4)]
    policy = [(row, first + t) for t in (0, 1, 5)]
    for position in injected:
        assert logprobs.grad[position].item() == 0.0 and entropy.grad[position].item() == 0.0
    for position in policy:
        assert logprobs.grad[position].item() != 0.0 and entropy.grad[position].item() != 0.0
    assert batch.engine_mask[row, first + 2:first + 5].sum() == 0  # the corrections and logprob_mismatch skip them too


class FakeEngine:
    """Stands in for the engine in these API tests: answers every call with the next token of a
    script. (The real engine runs the calculator example in tests/e2e/test_tool_use.py.)"""

    def __init__(self, script: list[int]):
        self.script, self.calls = list(script), []

    async def __call__(self, input_ids: list[int], params: SamplingParams) -> Generation:
        self.calls.append((list(input_ids), params.max_new_tokens))
        return Generation(list(input_ids), [self.script.pop(0)], [-0.25], "stop", 3)


def context(engine, tool_timeout_s=5.0, prompt_ids=(1, 2)):
    tokenizer = build_tokenizer()
    prompt = EncodedPrompt(PromptRecord("12*34+5?", "3", {"source": "test"}), list(prompt_ids))
    return RolloutContext(prompt, engine, tokenizer, SamplingParams(max_new_tokens=8), tool_timeout_s)


async def one_tool_call(prompt, ctx, tool):
    await ctx.generate(max_new_tokens=1)
    ctx.append(str(await ctx.call_tool(tool, prompt.text)))
    await ctx.generate(max_new_tokens=1)
    ctx.trajectory.info["checked"] = True


def test_a_generate_function_continues_from_the_whole_trajectory_and_passes_info_to_the_reward():
    tokenizer = build_tokenizer()
    digit = tokenizer.convert_tokens_to_ids("7")
    engine = FakeEngine([digit, digit])
    ctx = context(engine)
    generation = asyncio.run(run_generate_function(lambda p, c: one_tool_call(p, c, lambda text: 42), ctx))
    tool_ids = tokenizer("42", add_special_tokens=False)["input_ids"]
    assert engine.calls == [([1, 2], 1), ([1, 2, digit, *tool_ids], 1)]
    assert generation.response_ids == [digit, *tool_ids, digit]
    assert generation.loss_mask == [1, 0, 0, 1] and generation.tool_calls == 1 and generation.stop_reason is None
    assert generation_text(tokenizer, generation) == "7427"
    call = reward_call(ctx.prompt.record, generation, "7427")
    assert call.metadata == {"source": "test", "checked": True}


def test_a_raising_tool_ends_the_trajectory_with_its_reason():
    def broken_tool(text):
        raise ZeroDivisionError("no")

    tokenizer = build_tokenizer()
    engine = FakeEngine([tokenizer.convert_tokens_to_ids("7")] * 2)
    generation = asyncio.run(run_generate_function(lambda p, c: one_tool_call(p, c, broken_tool), context(engine)))
    assert generation.finish_reason == "tool_error"
    assert generation.stop_reason == "tool broken_tool raised ZeroDivisionError: no"
    assert len(engine.calls) == 1 and generation.loss_mask is None  # the policy token before the call stays
    assert trajectory_metrics([generation])["tool_errors"] == 1


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_hanging_tool_ends_the_trajectory_after_tool_timeout_s(asynchronous):
    def hang(text):
        time.sleep(20)

    async def hang_async(text):
        await asyncio.sleep(30)

    tokenizer = build_tokenizer()
    engine = FakeEngine([tokenizer.convert_tokens_to_ids("7")] * 2)
    tool = hang_async if asynchronous else hang
    start = time.monotonic()
    generation = asyncio.run(run_generate_function(lambda p, c: one_tool_call(p, c, tool),
                                                   context(engine, tool_timeout_s=0.2)))
    assert time.monotonic() - start < 10  # the trajectory did not wait for the tool
    assert generation.stop_reason == f"tool {tool.__name__} timed out after 0.2 s (rollout.tool_timeout_s)"
    assert generation.finish_reason == "tool_error"


def test_the_default_generate_function_is_one_engine_call():
    engine = FakeEngine([5])
    generation = asyncio.run(run_generate_function(single_turn, context(engine)))
    assert engine.calls == [([1, 2], 8)]
    assert generation.response_ids == [5] and generation.loss_mask is None and generation.turns == 1


def test_a_generate_function_must_return_a_trajectory():
    async def wrong(prompt, ctx):
        return "text"

    with pytest.raises(TypeError, match="must return a Trajectory"):
        asyncio.run(run_generate_function(wrong, context(FakeEngine([5]))))


def test_a_generate_function_that_raises_stops_the_run_with_its_traceback():
    """Not a ToolError: a bug in the function, reported with the prompt and the traceback (the
    manager is built without engines: the function fails before it calls one)."""
    from rlsys.errors import RunFailed
    from rlsys.rollout.manager import GenerateFunctionError, RolloutManager

    async def buggy(prompt, ctx):
        return {"tokens": []}["missing"]

    manager = RolloutManager(_no_engines(), vocab_size=64)
    try:
        prompt = EncodedPrompt(PromptRecord("4 7 2>", "2"), [1, 2])
        with pytest.raises(GenerateFunctionError, match="(?s)raised on prompt '4 7 2>'.*KeyError: 'missing'") as error:
            manager.trajectories([prompt], buggy, SamplingParams(), 2, build_tokenizer(), 5.0)
        assert isinstance(error.value, RunFailed)
    finally:
        manager._loop.close()


def test_token_ids_outside_the_vocabulary_are_found_negative_ones_too():
    from rlsys.rollout.trajectory import TokenIdOutOfVocabulary, check_token_ids

    check_token_ids([0, 5, 9], 10)
    check_token_ids([], 10)
    for ids, position, token_id in (([3, 10, 4], 1, 10), ([3, 4, -1], 2, -1), ([10**9], 0, 10**9)):
        with pytest.raises(TokenIdOutOfVocabulary) as error:
            check_token_ids(ids, 10)
        assert (error.value.position, error.value.token_id) == (position, token_id)
        assert str(error.value) == (f"token id {token_id} at position {position} of {len(ids)} input_ids is outside "
                                    "the model's vocabulary (ids 0..9: config.json vocab_size 10)")


def test_the_vocabulary_is_the_models_embedding_rows_not_the_tokenizers_length(tmp_path, tiny_model_dir):
    import json

    from rlsys.rollout.manager import model_vocab_size

    assert model_vocab_size(str(tiny_model_dir)) == json.loads((tiny_model_dir / "config.json").read_text())[
        "vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 151936}}))  # multimodal layout
    assert model_vocab_size(str(tmp_path)) == 151936


def test_a_generate_function_that_sends_an_out_of_vocabulary_id_stops_the_run_naming_it():
    """The id is refused before it reaches an engine (the manager has none: a call that got past
    the check would fail differently), with the function's path, the id, its position and the
    function's line."""
    from rlsys.errors import RunFailed
    from rlsys.rollout.manager import GenerateFunctionError, RolloutManager

    async def appends_a_bad_id(prompt, ctx):
        ctx.append([ctx.tokenizer.convert_tokens_to_ids("7"), 97])
        await ctx.generate()

    manager = RolloutManager(_no_engines(), vocab_size=97)
    try:
        prompt = EncodedPrompt(PromptRecord("4 7 2>", "2"), [1, 2])
        with pytest.raises(GenerateFunctionError) as error:
            manager.trajectories([prompt], appends_a_bad_id, SamplingParams(), 2, build_tokenizer(), 5.0,
                                 function_path="tools.py:appends_a_bad_id")
        message = str(error.value)
        assert message.startswith("rollout.generate_function 'tools.py:appends_a_bad_id' sent the engine input_ids "
                                  "it cannot take, on prompt '4 7 2>' at ")
        assert f"{__file__}:" in message and "(`await ctx.generate()`)" in message
        assert ("token id 97 at position 3 of 4 input_ids is outside the model's vocabulary (ids 0..96: config.json "
                "vocab_size 97). The request was not sent") in message
        assert isinstance(error.value, RunFailed)
    finally:
        manager._loop.close()


def test_prompt_token_ids_outside_the_vocabulary_never_reach_an_engine():
    from rlsys.errors import RunFailed
    from rlsys.rollout.manager import RolloutManager

    manager = RolloutManager(_no_engines(), vocab_size=50)
    try:
        with pytest.raises(RunFailed, match=r"prompt 1 of the batch: token id 50 at position 0 of 2 input_ids is "
                                            r"outside the model's vocabulary .*the tokenizer \(model.tokenizer_path\) "
                                            r"does not match the model"):
            manager.generate([[1, 2], [50, 3]], SamplingParams(), 2)
    finally:
        manager._loop.close()


def _no_engines():
    """A fleet of no engines (the tests using it fail before a request would reach one)."""
    from rlsys.rollout.fleet import EngineFleet

    fleet = object.__new__(EngineFleet)
    fleet.engines = []
    return fleet
