"""Learning-rate multipliers: linear warmup, then constant or cosine down to min_lr_ratio."""

import math

import pytest
import torch

from rlsys.actors.schedule import build_lr_scheduler, lr_multiplier


def test_warmup_then_constant():
    assert [lr_multiplier(s, "constant", 4, 100, 0.0) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_decays_from_one_to_its_floor():
    def cosine(step):
        return lr_multiplier(step, "cosine", warmup_steps=2, total_steps=12, min_lr_ratio=0.1)

    assert cosine(0) == 0.5 and cosine(2) == pytest.approx(1.0)
    assert cosine(7) == pytest.approx(0.1 + 0.9 * 0.5)  # half way through the 10 decay steps
    assert cosine(12) == pytest.approx(0.1) and cosine(50) == pytest.approx(0.1)
    assert cosine(4) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.2)))


def test_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="unknown lr schedule 'linear'"):
        lr_multiplier(5, "linear", 0, 10, 0.0)


def test_scheduler_applies_the_multipliers_to_the_optimizer():
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    scheduler = build_lr_scheduler(optimizer, "cosine", warmup_steps=2, total_steps=6, min_lr_ratio=0.0)
    seen = []
    for _ in range(7):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    expected = [1e-3 * lr_multiplier(s, "cosine", 2, 6, 0.0) for s in range(7)]
    assert seen == pytest.approx(expected)
