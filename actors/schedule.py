"""Learning-rate schedules: constant, or linear warmup then cosine decay to `min_lr_ratio`."""

from __future__ import annotations

import math

import torch

SCHEDULES = ("constant", "cosine")


# warmup: lr * (s + 1) / warmup;  cosine: lr * (min + (1 - min) * (1 + cos(pi * progress)) / 2)
def lr_multiplier(step: int, schedule: str, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    if schedule not in SCHEDULES:  # checked first: a wrong name must not pass while warming up
        raise ValueError(f"unknown lr schedule {schedule!r} (constant or cosine)")
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    decay_steps = max(total_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / decay_steps, 1.0)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(optimizer, schedule: str, warmup_steps: int, total_steps: int, min_lr_ratio: float):
    lr_multiplier(0, schedule, warmup_steps, total_steps, min_lr_ratio)  # validates the name
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, schedule, warmup_steps, total_steps, min_lr_ratio)
    )
