"""Built-in rule rewards, named in config as `rlsys.rewards:<name>`."""

import math
import re


def exact_match(prompt: str, response: str, label: str, metadata: dict) -> float:
    """1.0 when the response, stripped of surrounding whitespace, equals the label."""
    return 1.0 if response.strip() == label.strip() else 0.0


def contains_label(prompt: str, response: str, label: str, metadata: dict) -> float:
    """1.0 when the label appears anywhere in the response."""
    return 1.0 if label.strip() and label.strip() in response else 0.0


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number_match(prompt: str, response: str, label: str, metadata: dict) -> float:
    """1.0 when the last number in the response equals the label numerically (GSM8K style)."""
    numbers = _NUMBER.findall(response)
    if not numbers:
        return 0.0
    try:
        return 1.0 if math.isclose(float(numbers[-1]), float(label), rel_tol=0, abs_tol=1e-6) else 0.0
    except ValueError:
        return 0.0


def math_verify(prompt: str, response: str, label: str, metadata: dict) -> float:
    """1.0 when the response's final answer equals the label mathematically (GSM8K/MATH style:
    `\\boxed{}`, fractions, LaTeX, percentages, intervals), checked by the `math-verify` package.

    The label may be plain (`72`, `0.5`, `x^2+1`) or LaTeX with its own `$...$` or `\\boxed{}`.
    math-verify's own signal-based timeouts are off: they would reset the reward worker's timer,
    which bounds every call (reward.timeout_s)."""
    import logging

    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled" on every call
    gold_text = label if "$" in label or "\\boxed" in label else f"${label}$"
    gold = parse(gold_text, parsing_timeout=None)
    if not gold:
        raise ValueError(f"math_verify: cannot parse the label {label!r} as a math answer")
    answer = parse(response, parsing_timeout=None)
    return 1.0 if answer and verify(gold, answer, timeout_seconds=None) else 0.0
