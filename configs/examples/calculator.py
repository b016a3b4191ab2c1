"""A tool the model must learn to call: the calculator example (configs/examples/calculator.yaml).

The prompt is an expression and a question mark, "37*58+4?", and the answer is the last digit
of its value (here 0). Multiplying two-digit numbers is beyond the tiny model, so it has to
ask: when its first token is "[", the generate function runs the calculator on the prompt's
expression and appends the value and a closing bracket, "[2150]"; the model's next token is
its answer. Trajectory: prompt | "[" (policy) | "2150]" (tool output, masked out of the loss) |
"0" (policy). A first token other than "[" is taken as the answer, without the tool.

The reward gives 1 for the right answer and 0.1 for a wrong one after a well-formed call: an
untrained model calls the tool about once in 80 tries and then answers right once in 80, so
without that small credit for calling it would almost never see a reward.
"""

from __future__ import annotations

import re

CALL = "["
CALL_CREDIT = float(__import__("os").environ.get("CALC_CREDIT", "0.1"))
EXPRESSION = re.compile(r"^\s*(\d+)\s*\*\s*(\d+)\s*\+\s*(\d+)\s*$")


def calculator(expression: str) -> int:
    """a*b+c of the digits in the expression (the only form the tasks use)."""
    match = EXPRESSION.match(expression)
    if match is None:
        raise ValueError(f"the calculator reads 'a*b+c', not {expression!r}")
    a, b, c = (int(group) for group in match.groups())
    return a * b + c


async def generate(prompt, ctx, tool=calculator, max_tool_calls: int = 2):
    """One token at a time: "[" calls the tool on the prompt's expression; any other token is the answer."""
    for _ in range(max_tool_calls + 1):
        turn = await ctx.generate(max_new_tokens=1)
        if turn.text != CALL or ctx.trajectory.tool_calls >= max_tool_calls:
            break
        value = await ctx.call_tool(tool, prompt.text.rstrip("?"))
        ctx.append(f"{value}]")
    return ctx.trajectory


def reward(prompt: str, response: str, label: str, metadata: dict) -> float:
    """1 for the right answer (the token after the last tool output); 0.1 for a wrong answer
    after a completed call."""
    called = "]" in response
    answer = response.rpartition("]")[2] if called else response
    if answer.strip() == label.strip():
        return 1.0
    return CALL_CREDIT if called else 0.0
