"""Learning-rate multipliers at hand-computed steps, and the LambdaLR built from them on a real
optimizer. Warmup: (s + 1) / warmup; cosine: min + (1 - min) * (1 + cos(pi * progress)) / 2."""

from __future__ import annotations

import math

import pytest
import torch

from rlsys.actors.schedule import build_lr_scheduler, lr_multiplier


@pytest.mark.parametrize("step", [0, 1, 7, 1000])
def test_constant_without_warmup_is_one_at_every_step(step):
    assert lr_multiplier(step, "constant", warmup_steps=0, total_steps=10, min_lr_ratio=0.1) == 1.0


@pytest.mark.parametrize(("step", "expected"), [(0, 0.25), (1, 0.5), (2, 0.75), (3, 1.0), (4, 1.0), (100, 1.0)])
def test_warmup_then_constant_ramps_linearly_and_reaches_one_at_the_last_warmup_step(step, expected):
    assert lr_multiplier(step, "constant", warmup_steps=4, total_steps=10, min_lr_ratio=0.1) == pytest.approx(expected)


# warmup 4, total 12: decay over steps 4 .. 12 (8 steps), floor 0.1
@pytest.mark.parametrize(
    ("step", "expected"),
    [
        (0, 0.25),  # first step of the warmup
        (3, 1.0),  # last warmup step
        (4, 1.0),  # cosine at progress 0
        (6, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4))),  # progress 1/4
        (8, 0.1 + 0.9 / 2),  # midpoint: min + (1 - min) / 2 = 0.55
        (12, 0.1),  # end of the decay
        (13, 0.1),  # beyond: stays at the floor
        (1000, 0.1),
    ],
)
def test_cosine_with_warmup_at_hand_computed_steps(step, expected):
    assert lr_multiplier(step, "cosine", warmup_steps=4, total_steps=12, min_lr_ratio=0.1) == pytest.approx(expected)


def test_cosine_without_warmup_starts_at_one_and_decays_to_the_floor():
    values = [lr_multiplier(s, "cosine", warmup_steps=0, total_steps=10, min_lr_ratio=0.2) for s in range(12)]
    assert values[0] == pytest.approx(1.0)
    assert values[5] == pytest.approx(0.6)  # midpoint: 0.2 + 0.8 / 2
    assert values[10] == pytest.approx(0.2) and values[11] == pytest.approx(0.2)
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))  # never increases


def test_cosine_with_a_zero_floor_ends_at_zero():
    assert lr_multiplier(10, "cosine", warmup_steps=2, total_steps=10, min_lr_ratio=0.0) == pytest.approx(0.0)


@pytest.mark.parametrize("warmup_steps", [0, 3])
def test_unknown_schedule_is_rejected_after_the_warmup(warmup_steps):
    with pytest.raises(ValueError, match="unknown lr schedule 'linear'"):
        lr_multiplier(5, "linear", warmup_steps=warmup_steps, total_steps=10, min_lr_ratio=0.0)


def test_build_lr_scheduler_rejects_an_unknown_schedule():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match="unknown lr schedule"):
        build_lr_scheduler(optimizer, "linear", warmup_steps=0, total_steps=10, min_lr_ratio=0.0)


def test_build_lr_scheduler_rejects_an_unknown_schedule_even_with_warmup():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match="unknown lr schedule"):
        build_lr_scheduler(optimizer, "linear", warmup_steps=3, total_steps=10, min_lr_ratio=0.0)


def _lrs_while_stepping(schedule: str, steps: int, base_lr: float, **kwargs) -> list[float]:
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=base_lr)
    scheduler = build_lr_scheduler(optimizer, schedule, **kwargs)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        parameter.grad = torch.ones(1)
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["initial_lr"] == base_lr
    return lrs


def test_scheduler_on_a_real_optimizer_gives_the_cosine_multipliers_times_the_base_lr():
    base_lr = 0.2
    kwargs = dict(warmup_steps=4, total_steps=12, min_lr_ratio=0.1)
    lrs = _lrs_while_stepping("cosine", 15, base_lr, **kwargs)
    assert lrs == pytest.approx([base_lr * lr_multiplier(s, "cosine", **kwargs) for s in range(15)])
    # the same values, by hand, at the landmarks
    assert lrs[0] == pytest.approx(0.05)  # 0.2 * 1/4
    assert lrs[3] == pytest.approx(0.2) and lrs[4] == pytest.approx(0.2)
    assert lrs[8] == pytest.approx(0.2 * 0.55)
    assert lrs[12] == pytest.approx(0.02) and lrs[14] == pytest.approx(0.02)


def test_scheduler_on_a_real_optimizer_with_warmup_then_constant():
    lrs = _lrs_while_stepping("constant", 6, 1e-3, warmup_steps=2, total_steps=6, min_lr_ratio=0.5)
    assert lrs == pytest.approx([5e-4, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3])


def test_scheduler_on_a_real_optimizer_with_constant_and_no_warmup_keeps_the_base_lr():
    lrs = _lrs_while_stepping("constant", 4, 3e-4, warmup_steps=0, total_steps=4, min_lr_ratio=0.0)
    assert lrs == pytest.approx([3e-4] * 4)
