"""Built-in synthetic tasks with rule-checkable answers, for runs without a dataset.

Prompts are digit strings such as `"4 7 2>"`; the answer is one digit (the model should answer
it and then end the sequence). Train and eval prompts are disjoint, so eval measures the rule,
not memorised prompts. An untrained model answers right about once in `vocab size` tries.

`calculator` is the tool-use task of configs/examples/calculator.yaml: `"37*58+4?"` (two numbers
from 32 to 99 and a digit), answered by the last digit of the value (2150 -> "0"); a model
without a calculator has to multiply in its head.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from rlsys.config import ConfigError, SyntheticTaskConfig

_ANSWER_RULES = {
    "max_digit": lambda digits: max(digits),
    "first_digit": lambda digits: digits[0],
    "last_digit": lambda digits: digits[-1],
    "sum_mod10": lambda digits: sum(digits) % 10,
}


def _example(digits: list[int], task: str) -> TaskExample:
    prompt = " ".join(str(d) for d in digits) + ">"
    return TaskExample(prompt=prompt, label=str(_ANSWER_RULES[task](digits)), task=task)


@dataclass(frozen=True)
class TaskExample:
    prompt: str
    label: str
    task: str


_FACTORS = range(32, 100)  # two-digit factors whose products all have four digits


def _calculator_example(code: int) -> TaskExample:
    code, c = divmod(code, 10)
    a, b = (_FACTORS[i] for i in divmod(code, len(_FACTORS)))
    return TaskExample(prompt=f"{a}*{b}+{c}?", label=str((a * b + c) % 10), task="calculator")


def generate_task(config: SyntheticTaskConfig) -> tuple[list[TaskExample], list[TaskExample]]:
    """(train, eval) examples with no prompt in both."""
    if config.task == "calculator":
        space, describe = len(_FACTORS) ** 2 * 10, "the calculator task gives"
    else:
        space, describe = 10**config.num_digits, f"{config.num_digits} digits give"
    wanted = config.num_train + config.num_eval
    if wanted > space:
        raise ConfigError(
            f"invalid config: data.synthetic asks for {wanted} distinct prompts but {describe} only {space}; lower "
            "num_train/num_eval" + ("" if config.task == "calculator" else " or raise num_digits")
        )
    rng = random.Random(config.seed)
    codes = rng.sample(range(space), wanted)
    if config.task == "calculator":
        examples = [_calculator_example(code) for code in codes]
    else:
        examples = [_example([int(c) for c in str(code).zfill(config.num_digits)], config.task) for code in codes]
    return examples[config.num_eval:], examples[: config.num_eval]
