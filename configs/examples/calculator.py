"""A tool the model must learn to call: the calculator example (configs/examples/calculator.yaml).

The prompt is an expression and a question mark, "37*58+4?", and the answer is the last digit
of its value (here 0). Multiplying two-digit numbers is beyond the tiny model, so it has to
ask: the model writes up to 8 tokens, and a "[" among them calls the calculator on the prompt's
expression, whose value is appended ("[2150"); the model's next token is its answer.
Trajectory: prompt | "[" (policy) | "2150" (tool output, masked out of the loss) | "0" (policy).
Without a "[", what the model wrote is its answer.

The reward gives 1 for the right answer and 0.2 for a wrong digit after a call: an untrained
model calls the tool in about 1 of 10 tries and then answers right about 1 time in 80, so
without that small credit for a well-formed call it would almost never see a reward. (Credit for
any answer after a call would also reward the random tokens that follow early calls, and the
answer would settle on non-digits before copying the value could be learned.)
"""

from __future__ import annotations

import re

CALL = "["
CALL_CREDIT = 0.2
EXPRESSION = re.compile(r"^\s*(\d+)\s*\*\s*(\d+)\s*\+\s*(\d+)\s*$")


def calculator(expression: str) -> int:
    """a*b+c of the digits in the expression (the only form the tasks use)."""
    match = EXPRESSION.match(expression)
    if match is None:
        raise ValueError(f"the calculator reads 'a*b+c', not {expression!r}")
    a, b, c = (int(group) for group in match.groups())
    return a * b + c


async def generate(prompt, ctx, tool=calculator, call_within: int = 8):
    """Up to `call_within` tokens; the engine stops at a "[", which calls the tool. The answer
    (the model's token after the tool's value) goes to the reward in `metadata["answer"]`."""
    call_id = ctx.encode(CALL)[0]
    turn = await ctx.generate(max_new_tokens=call_within, stop_token_ids=[*ctx.sampling.stop_token_ids, call_id])
    called = turn.token_ids[-1:] == [call_id]
    if called:
        value = await ctx.call_tool(tool, prompt.text.rstrip("?"))
        ctx.append(str(value))
        turn = await ctx.generate(max_new_tokens=1)
    ctx.trajectory.info.update(called=called, answer=turn.text)
    return ctx.trajectory


def reward(prompt: str, response: str, label: str, metadata: dict) -> float:
    """1 for the right answer; CALL_CREDIT for a wrong digit after a call."""
    answer = metadata.get("answer", response).strip()
    if answer == label.strip():
        return 1.0
    return CALL_CREDIT if metadata.get("called") and answer.isdigit() else 0.0
