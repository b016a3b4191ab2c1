"""Built-in synthetic tasks with rule-checkable answers, for runs without a dataset.

Prompts are digit strings such as `"4 7 2>"`; the answer is one digit (the model should answer
it and then end the sequence). Train and eval prompts are disjoint, so eval measures the rule,
not memorised prompts. An untrained model answers right about once in `vocab size` tries.

`calculator` is the tool-use task of configs/examples/calculator.yaml: `"37*58+4?"` (two numbers
from 32 to 99 and a digit), answered by the last digit of the value (2150 -> "0"); a model
without a calculator has to multiply in its head.

`square_color` is a vision-language model's (configs/quickstart_vlm.yaml): one PNG per prompt, 28
to 56 pixels a side, grey, with a square of red, green, blue or yellow somewhere on it (its side
half to all of the image's shorter one, each channel jittered); the prompt is always "color?" and the
answer the colour's letter (r, g, b, y). Only the image tells them apart: with `blank_images` the
square is left out and no model can beat 1 in 4 (the labels are balanced in each split).
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
    images: tuple[bytes, ...] = ()


_FACTORS = range(32, 100)  # two-digit factors whose products all have four digits


def _calculator_example(code: int) -> TaskExample:
    code, c = divmod(code, 10)
    a, b = (_FACTORS[i] for i in divmod(code, len(_FACTORS)))
    return TaskExample(prompt=f"{a}*{b}+{c}?", label=str((a * b + c) % 10), task="calculator")


_SQUARE_COLORS = {"r": (220, 30, 30), "g": (30, 200, 30), "b": (30, 30, 220), "y": (230, 220, 30)}
_SQUARE_SIDES = (28, 42, 56)  # pixels; the processor resizes to multiples of 28: 1, 2 or 4 image tokens


def _square_image(rng: random.Random, label: str, blank: bool) -> bytes:
    import io

    from PIL import Image, ImageDraw

    width, height = rng.choice(_SQUARE_SIDES), rng.choice(_SQUARE_SIDES)
    grey = rng.randrange(100, 156)
    image = Image.new("RGB", (width, height), (grey, grey, grey))
    side = rng.randrange(min(width, height) // 2, min(width, height) + 1)
    left, top = rng.randrange(0, width - side + 1), rng.randrange(0, height - side + 1)
    fill = tuple(min(255, max(0, channel + rng.randrange(-25, 26))) for channel in _SQUARE_COLORS[label])
    if not blank:
        ImageDraw.Draw(image).rectangle((left, top, left + side - 1, top + side - 1), fill=fill)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _square_color_task(config: SyntheticTaskConfig) -> tuple[list[TaskExample], list[TaskExample]]:
    rng = random.Random(config.seed)
    labels = list(_SQUARE_COLORS)

    def split(count: int) -> list[TaskExample]:
        chosen = [labels[i % len(labels)] for i in range(count)]  # balanced: chance is 1 in 4 whatever is answered
        rng.shuffle(chosen)
        return [TaskExample("color?", label, "square_color", (_square_image(rng, label, config.blank_images),))
                for label in chosen]

    eval_ = split(config.num_eval)
    return split(config.num_train), eval_


def generate_task(config: SyntheticTaskConfig) -> tuple[list[TaskExample], list[TaskExample]]:
    """(train, eval) examples with no prompt in both (square_color: no image in both, each drawn at random)."""
    if config.task == "square_color":
        return _square_color_task(config)
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
