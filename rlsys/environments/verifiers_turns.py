"""A verifiers MultiTurnEnv's turns as rlsys's generate function, token in, token out.

The protocol is the environment's own, driven as MultiTurnEnv.rollout drives it: `setup_state`, then
while no stop condition of the environment holds (`is_completed`: max_turns, a ToolEnv's "no tool
called", a final env response, ...): the next prompt messages from `get_prompt_messages` (which calls
`env_response` after the first turn), then one policy turn. Only the model is rlsys's: each turn is
one engine call continuing the trajectory's token ids, so the trainer trains exactly the tokens the
engine sampled. What the environment says between turns is rendered by the policy's chat template
(the text it adds to the conversation so far) and appended as injected tokens, masked out of the
loss. An assistant turn's `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (the Qwen
and Hermes form) become its tool calls, which a ToolEnv runs. The state the turns built is what the
rubric scores (rlsys/environments/verifiers_scoring.py).
"""

from __future__ import annotations

import json
import re
import uuid

from rlsys.environments.verifiers_rows import VerifiersTaskError, plain_message
from rlsys.environments.verifiers_scoring import STATE_KEY
from rlsys.records import EncodedPrompt
from rlsys.rollout.trajectory import RolloutContext, Trajectory

TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
SENTINEL = "\x00rlsys-turn-end\x00"


def parse_assistant_turn(text: str):
    """A vf.AssistantMessage from a turn's text: its <tool_call> blocks as tool calls (a block that is
    not JSON with a `name` stays in the content, where the environment can see what was written)."""
    import verifiers as vf
    from verifiers.types import ToolCall

    calls, kept = [], text
    for match in TOOL_CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
            name, arguments = call["name"], call.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            continue
        calls.append(ToolCall(id=f"call_{uuid.uuid4().hex[:12]}", name=str(name),
                              arguments=arguments if isinstance(arguments, str) else json.dumps(arguments)))
        kept = kept.replace(match.group(0), "")
    return vf.AssistantMessage(content=kept.strip() if calls else text, tool_calls=calls or None)


def template_message(message) -> dict:
    """A vf message as chat templates read it (tool calls in OpenAI's function form)."""
    plain = plain_message(message)
    if plain.get("tool_calls"):
        plain["tool_calls"] = [{"type": "function", "id": call["id"],
                                "function": {"name": call["name"], "arguments": _arguments(call["arguments"])}}
                               for call in plain["tool_calls"]]
    return plain


def _arguments(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


class VerifiersTurns:
    """`await turns(prompt, ctx)`: one sample's trajectory through the environment's turns."""

    def __init__(self, task, states: dict):
        """`task`: the VerifiersTask (rlsys/environments/verifiers_task.py) whose environment runs the turns."""
        self.task = task
        self.states = states  # state id -> the vf.State its turns built, for the rubric

    async def __call__(self, prompt: EncodedPrompt, ctx: RolloutContext) -> Trajectory:
        environment = self.task.environment
        state = self.task.new_state(self.task.row_of(prompt.record.metadata))
        state = await environment.setup_state(state) or state
        conversation = list(state["prompt"])  # what the trajectory's tokens hold so far, as messages
        tools = list(prompt.record.tools) or None
        while not await environment.is_completed(state):
            messages = await environment.get_prompt_messages(state)
            if state.get("final_env_response") is not None:
                continue  # the environment ended the episode: is_completed says so next
            if len(messages) > len(conversation):
                self._inject(ctx, conversation, messages, tools)
                conversation = list(messages)
            completion = await ctx.generate()
            assistant = parse_assistant_turn(_turn_text(ctx, completion.token_ids))
            state["trajectory"].append({
                "prompt": messages, "completion": [assistant], "response": None, "tokens": None, "reward": None,
                "advantage": None, "is_truncated": completion.finish_reason == "length",
                "trajectory_id": state.get("trajectory_id", ""), "extras": {}})
            conversation.append(assistant)
            # A turn cut at max_new_tokens is flagged, as verifiers flags it, and the episode goes on (the
            # template's end of turn is injected after it): the environment's stop conditions end it.
            state["is_truncated"] = state["is_truncated"] or completion.finish_reason == "length"
        await environment.render_completion(state)
        state["is_completed"] = True
        state_id = uuid.uuid4().hex
        self.states[state_id] = state
        ctx.trajectory.info[STATE_KEY] = state_id
        ctx.trajectory.tool_calls = sum(len(step["completion"][-1].tool_calls or []) for step in state["trajectory"])
        return ctx.trajectory

    def _inject(self, ctx: RolloutContext, before: list, after: list, tools: list | None) -> None:
        """Append, as injected tokens, what the chat template adds between the policy's last turn (as
        the engine ended it) and the environment's next messages, up to the next assistant turn's start."""
        template = ctx.tokenizer.apply_chat_template
        said = template([template_message(m) for m in before], tools=tools, tokenize=False)
        then = template([template_message(m) for m in after], tools=tools, add_generation_prompt=True, tokenize=False)
        if not then.startswith(said):
            raise VerifiersTaskError(
                f"task.verifiers: the environment's next prompt does not extend the conversation so far (its "
                f"get_prompt_messages rewrites earlier messages), so its turns cannot continue one token sequence: "
                f"{said[-200:]!r} is not the start of {then[:len(said)][-200:]!r}")
        ctx.append(self._turn_end_missing(ctx) + then[len(said):])

    def _turn_end_missing(self, ctx: RolloutContext) -> str:
        """What the template closes an assistant turn with (`<|im_end|>\\n`) that the engine's tokens of the
        last turn lack (it stops on the end token; the newline after it is the template's)."""
        rendered = ctx.tokenizer.apply_chat_template([{"role": "assistant", "content": SENTINEL}], tokenize=False)
        turn_end = rendered[rendered.index(SENTINEL) + len(SENTINEL):]
        said = ctx.decode(ctx.trajectory.response_ids[-len(ctx.tokenizer(turn_end, add_special_tokens=False)
                                                          ["input_ids"]) - 1:])
        for cut in range(len(turn_end), 0, -1):
            if said.endswith(turn_end[:cut]):
                return turn_end[cut:]
        return turn_end


def _turn_text(ctx: RolloutContext, token_ids: list[int]) -> str:
    """A turn's text as the environment reads it: without the end-of-turn token and other special tokens."""
    return ctx.tokenizer.decode(token_ids, skip_special_tokens=True)
