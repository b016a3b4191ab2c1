"""A verifiers environment (configs/examples/verifiers_digits.yaml; docs/bring-your-own-task.md): the
quickstart's last-digit task as chat prompts. Single-turn: a rubric of two weighted functions, one
async. `multi_turn=True`: two turns and a tool: after the model's first answer the environment runs
its `echo_back` tool on it and asks for the answer again; the second answer is scored."""

from __future__ import annotations

import asyncio
import random

import verifiers as vf
from datasets import Dataset


def _rows(seed: int, count: int, exclude: set[str] = frozenset()) -> list[dict]:
    rng, rows, seen = random.Random(seed), [], set(exclude)
    while len(rows) < count:
        digits = [rng.randrange(10) for _ in range(3)]
        question = " ".join(map(str, digits)) + ">"
        if question not in seen:
            seen.add(question)
            rows.append({"question": question, "answer": str(digits[-1]), "info": {"digits": digits}})
    return rows


def echo_back(text: str) -> str:
    """The tool: what the model said, as the environment heard it."""
    return f"heard {text.strip()[:8]!r}"


class TwoTurnEnv(vf.MultiTurnEnv):
    """Turn 1: the model answers; the environment runs `echo_back` on it and asks again; turn 2 is scored."""

    async def env_response(self, messages, state, **kwargs):
        said = messages[-1].content or ""
        return [vf.UserMessage(content=f"{echo_back(said)}; again>")]


def load_environment(num_train: int = 400, num_eval: int = 16, multi_turn: bool = False,
                     brevity_weight: float = 0.5):
    parser = vf.Parser()

    def correct(completion, answer, **kwargs) -> float:
        return 1.0 if (parser.parse_answer(completion) or "").strip() == answer else 0.0

    async def brief(completion, info) -> float:  # async, and reads the row's info
        await asyncio.sleep(0)
        text = (parser.parse_answer(completion) or "").strip()
        return 1.0 if len(text) == 1 and text.isdigit() and len(info["digits"]) == 3 else 0.0

    rubric = vf.Rubric(funcs=[correct, brief], weights=[1.0, brevity_weight], parser=parser)
    eval_rows = _rows(1, num_eval)
    train_rows = _rows(0, num_train, {row["question"] for row in eval_rows})
    common = dict(dataset=Dataset.from_list(train_rows), eval_dataset=Dataset.from_list(eval_rows), parser=parser,
                  rubric=rubric)
    if multi_turn:
        return TwoTurnEnv(max_turns=2, **common)
    return vf.SingleTurnEnv(**common)
