"""Multi-turn rollouts: what a custom generate function works with and what it returns.

`rollout.generate_function: path/to/file.py:fn` (or `package.module:fn`) names an async function

    async def fn(prompt: EncodedPrompt, ctx: RolloutContext) -> Trajectory | None

called once per sample. It may call the engine several times (`await ctx.generate()`), run tools
in between (`await ctx.call_tool(tool, *args)`) and put their output into the sequence
(`ctx.append(text)`). Everything lands in `ctx.trajectory`: all token ids after the prompt, a loss
mask (1 = sampled by the policy, 0 = injected: tool output, chat markup, ...) and the engine's
log-prob of every policy token. Returning None means "ctx.trajectory". `Trajectory.info` reaches
the reward function inside its `metadata` argument.

A tool that raises, or runs longer than `rollout.tool_timeout_s`, raises `ToolError` out of
`call_tool`; if the function lets it escape, the trajectory ends there with `stop_reason` set
and is rewarded as it stands (counted in the `tool_errors` metric). A synchronous tool runs in a
thread of its own; one that times out cannot be interrupted, so its thread is left to finish on
its own (tools should not hold locks).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

from rlsys.records import EncodedPrompt, Generation, SamplingParams


@dataclass
class Completion:
    """One engine call's answer."""

    token_ids: list[int]
    logprobs: list[float]  # engine log-prob of each token
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: int
    text: str = ""  # decoded with special tokens kept


class ToolError(RuntimeError):
    """A tool raised or ran past rollout.tool_timeout_s; the trajectory ends with `reason`."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class Trajectory:
    """A prompt and everything after it, with who produced each token."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)  # per response token: 1 = policy, 0 = injected
    logprobs: list[float] = field(default_factory=list)  # per response token (0.0 where injected)
    finish_reason: str = "stop"  # of the last engine call, or "tool_error"
    stop_reason: str | None = None  # why it ended early (a tool's error), None when it ended normally
    turns: int = 0  # engine calls
    tool_calls: int = 0
    weight_versions: list[int] = field(default_factory=list)  # of each engine call
    info: dict = field(default_factory=dict)  # passed to the reward function inside `metadata`

    @property
    def token_ids(self) -> list[int]:
        """The whole sequence so far: what the next engine call continues."""
        return self.prompt_ids + self.response_ids

    def add_generated(self, completion: Completion) -> None:
        """The policy's tokens: they count in the loss."""
        if len(completion.logprobs) != len(completion.token_ids):
            raise ValueError(f"{len(completion.logprobs)} log-probs for {len(completion.token_ids)} generated tokens")
        self.response_ids += completion.token_ids
        self.loss_mask += [1] * len(completion.token_ids)
        self.logprobs += completion.logprobs
        self.finish_reason = completion.finish_reason
        self.weight_versions.append(completion.weight_version)
        self.turns += 1

    def add_injected(self, token_ids: list[int]) -> None:
        """Tokens the policy did not sample (tool output, markup): masked out of the loss."""
        self.response_ids += list(token_ids)
        self.loss_mask += [0] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)

    def to_generation(self) -> Generation:
        if not len(self.response_ids) == len(self.loss_mask) == len(self.logprobs):
            raise ValueError(f"a trajectory with {len(self.response_ids)} response tokens has {len(self.loss_mask)} "
                             f"mask values and {len(self.logprobs)} log-probs; build it with add_generated/add_injected")
        return Generation(
            prompt_ids=list(self.prompt_ids), response_ids=list(self.response_ids), logprobs=list(self.logprobs),
            finish_reason=self.finish_reason,
            # the oldest weights any of its tokens came from: what staleness is measured by
            weight_version=min(self.weight_versions, default=-1),
            loss_mask=None if all(self.loss_mask) else list(self.loss_mask),
            turns=self.turns, tool_calls=self.tool_calls, stop_reason=self.stop_reason, info=dict(self.info),
            multi_turn=True,
        )


EngineCall = Callable[[list[int], SamplingParams], Awaitable[Generation]]


class TokenIdOutOfVocabulary(ValueError):
    """Token ids for an engine hold one its embedding has no row for: sent, it would crash the
    engine (an IndexError in its log), so it is refused before it leaves the driver."""

    def __init__(self, token_id: int, position: int, length: int, vocab_size: int):
        self.token_id, self.position = token_id, position
        super().__init__(f"token id {token_id} at position {position} of {length} input_ids is outside the "
                         f"model's vocabulary (ids 0..{vocab_size - 1}: config.json vocab_size {vocab_size})")


def check_token_ids(token_ids: list[int], vocab_size: int) -> None:
    """TokenIdOutOfVocabulary for the first id that is negative or >= vocab_size."""
    if token_ids and 0 <= min(token_ids) and max(token_ids) < vocab_size:
        return
    for position, token_id in enumerate(token_ids):
        if not 0 <= token_id < vocab_size:
            raise TokenIdOutOfVocabulary(token_id, position, len(token_ids), vocab_size)


class RolloutContext:
    """What a generate function gets besides its prompt: the engine, the tokenizer, the run's
    sampling parameters, a tool runner, and the trajectory being built."""

    def __init__(self, prompt: EncodedPrompt, engine: EngineCall, tokenizer, sampling: SamplingParams,
                 tool_timeout_s: float):
        self.prompt = prompt
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.tool_timeout_s = tool_timeout_s
        self.trajectory = Trajectory(prompt_ids=list(prompt.token_ids))
        self._engine = engine

    async def complete(self, input_ids: list[int], **sampling_overrides) -> Completion:
        """One engine call on any token ids; nothing is added to the trajectory."""
        params = replace(self.sampling, **sampling_overrides)
        generation = await self._engine(list(input_ids), params)
        return Completion(generation.response_ids, generation.logprobs, generation.finish_reason,
                          generation.weight_version, self.decode(generation.response_ids))

    async def generate(self, **sampling_overrides) -> Completion:
        """Continue the trajectory with the policy (`max_new_tokens=4`, `stop=[...]`, ... override
        the run's sampling parameters for this call); its tokens are added as policy tokens."""
        completion = await self.complete(self.trajectory.token_ids, **sampling_overrides)
        self.trajectory.add_generated(completion)
        return completion

    def append(self, text_or_ids: str | list[int]) -> list[int]:
        """Add injected tokens (masked out of the loss): text is tokenised without special tokens."""
        ids = self.encode(text_or_ids) if isinstance(text_or_ids, str) else list(text_or_ids)
        self.trajectory.add_injected(ids)
        return ids

    async def call_tool(self, tool: Callable, *args, **kwargs):
        """Run `tool(*args, **kwargs)` (sync in a thread, or a coroutine function) under
        rollout.tool_timeout_s; its result, or ToolError."""
        self.trajectory.tool_calls += 1
        name = getattr(tool, "__name__", repr(tool))
        try:
            call = tool(*args, **kwargs) if inspect.iscoroutinefunction(tool) else _in_own_thread(tool, *args, **kwargs)
            return await asyncio.wait_for(call, self.tool_timeout_s)
        except TimeoutError:
            raise ToolError(f"tool {name} timed out after {self.tool_timeout_s:g} s (rollout.tool_timeout_s)") from None
        except Exception as error:  # noqa: BLE001 - any failure of user code ends the trajectory
            raise ToolError(f"tool {name} raised {type(error).__name__}: {error}") from error

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)


def _in_own_thread(function: Callable, *args, **kwargs) -> asyncio.Future:
    """`function` in a new daemon thread: a tool that hangs past its timeout keeps only its own
    thread (a shared pool would run out of workers and stall every later tool call)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result, error) -> None:
        if not future.done():  # wait_for may have cancelled it
            future.set_exception(error) if error is not None else future.set_result(result)

    def run() -> None:
        try:
            result, error = function(*args, **kwargs), None
        except BaseException as exception:  # noqa: BLE001 - handed to the awaiting trajectory
            result, error = None, exception
        if not loop.is_closed():
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="rlsys-tool", daemon=True).start()
    return future


GenerateFunction = Callable[[EncodedPrompt, RolloutContext], Awaitable[Trajectory | None]]


async def single_turn(prompt: EncodedPrompt, ctx: RolloutContext) -> Trajectory:
    """The default: one engine call."""
    await ctx.generate()
    return ctx.trajectory


async def run_generate_function(function: GenerateFunction, ctx: RolloutContext) -> Generation:
    """`function` on one sample; a ToolError that escapes ends the trajectory where it stood."""
    try:
        trajectory = await function(ctx.prompt, ctx) or ctx.trajectory
    except ToolError as error:
        trajectory = ctx.trajectory
        trajectory.finish_reason, trajectory.stop_reason = "tool_error", error.reason
    if not isinstance(trajectory, Trajectory):
        raise TypeError(f"a generate function must return a Trajectory (or None), not {type(trajectory).__name__}")
    return trajectory.to_generation()
