"""Trainer-side checkpoints: sharded model + optimizer through torch.distributed.checkpoint (DCP),
plus each rank's scheduler and RNG states. The caller (rlsys/run/checkpointing.py) makes the
directory appear atomically."""

from __future__ import annotations

from pathlib import Path

import torch

# torch.distributed.checkpoint is imported where it is used: it takes ~0.6 s, and the driver, which
# imports this module with the trainer's (to create the trainer actors), never checkpoints itself.


def _rank_file(directory: Path, rank: int) -> Path:
    return directory / f"trainer_rank{rank}.pt"


def _options(trained_only: bool):
    """`trained_only` (LoRA): the parameters that train and their optimizer state; the frozen base
    is the checkpoint model.path names, read again at start-up."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=trained_only, strict=not trained_only)


def save_trainer_checkpoint(directory: Path, model, optimizer, scheduler, rank: int, trained_only: bool = False) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer, options=_options(trained_only))
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(directory / "dcp"))
    torch.save(
        {"scheduler": scheduler.state_dict(), "rng": torch.get_rng_state()},
        _rank_file(directory, rank),
    )


def load_trainer_checkpoint(directory: Path, model, optimizer, scheduler, rank: int, trained_only: bool = False) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not (directory / "dcp").is_dir():
        raise FileNotFoundError(f"{directory} holds no trainer checkpoint (no dcp/ directory)")
    options = _options(trained_only)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(directory / "dcp"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
    extra = torch.load(_rank_file(directory, rank), weights_only=False)
    scheduler.load_state_dict(extra["scheduler"])
    torch.set_rng_state(extra["rng"])
