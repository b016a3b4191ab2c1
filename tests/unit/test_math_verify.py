"""The math_verify built-in reward on hand-written GSM8K/MATH-style answers."""

import pytest

from rlsys.records import RewardCall
from rlsys.rewards.builtin import math_verify
from rlsys.rewards.loading import load_reward_function
from rlsys.rewards.pool import score_calls


@pytest.mark.parametrize("label, response, expected", [
    ("72", "Natalia sold 48 + 24 = 72 clips.\n#### 72", 1.0),
    ("72", "The answer is \\boxed{72}.", 1.0),
    ("72", "The answer is \\boxed{73}.", 0.0),
    ("\\frac{1}{2}", "So the probability is $\\frac{1}{2}$.", 1.0),
    ("\\frac{1}{2}", "The answer is \\boxed{0.5}", 1.0),
    ("0.5", "\\boxed{\\frac12}", 1.0),
    ("\\frac{1}{2}", "\\boxed{\\frac{1}{3}}", 0.0),
    ("x^2+1", "\\boxed{1+x^2}", 1.0),
    ("\\sqrt{2}", "$\\sqrt 2$", 1.0),
    ("10\\%", "\\boxed{10\\%}", 1.0),
    ("(1,2)", "the interval is \\boxed{(1, 2)}", 1.0),
    ("1,000", "\\boxed{1000}", 1.0),
    ("3", "First I thought 2, but the answer is \\boxed{3}", 1.0),
    ("72", "seventy-two", 0.0),
    ("$\\boxed{4}$", "\\boxed{4}", 1.0),
])
def test_math_answers(label, response, expected):
    assert math_verify("prompt", response, label, {}) == expected


def test_it_runs_as_a_named_reward_under_the_workers_timer():
    function = load_reward_function("rlsys.rewards:math_verify")
    outcomes = score_calls(function, [RewardCall("p", "\\boxed{2}", "2", {}), RewardCall("p", "x", "", {})],
                           timeout_s=30)
    assert outcomes[0].value == 1.0
    assert "cannot parse the label" in outcomes[1].error
