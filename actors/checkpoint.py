"""Trainer-side checkpoints: the model and optimizer through torch.distributed.checkpoint (DCP),
plus each rank's scheduler and RNG state in `trainer_rank{r}.pt`. The caller
(rlsys/run/checkpointing.py) makes the directory appear atomically.

Nothing in a checkpoint pins the layout that wrote it: it resumes on any number of ranks (any
context-parallel split of them), FSDP2-sharded or a lone fp32 rank's whole model. DCP stores
every tensor by its global name and shape, and reads each rank's part (a DTensor shard, or the
whole tensor) back from whichever files hold it, optimizer moments and step counts included. The
scheduler state is the same on every rank. The RNG state is each rank's own: a rank r of a resumed
run continues saving rank r's stream, or rank r mod N's when N ranks wrote the checkpoint.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

# torch.distributed.checkpoint is imported where it is used: it takes ~0.6 s, and the driver, which
# imports this module with the trainer's (to create the trainer actors), never checkpoints itself.

logger = logging.getLogger(__name__)


def _rank_file(directory: Path, rank: int) -> Path:
    return directory / f"trainer_rank{rank}.pt"


def _options(trained_only: bool):
    """`trained_only` (LoRA): the parameters that train and their optimizer state; the frozen base
    is the checkpoint model.path names, read again at start-up."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=trained_only, strict=not trained_only)


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def saved_rank_count(directory: Path) -> int:
    """How many ranks wrote the checkpoint in `directory`: recorded in every rank file; a checkpoint
    from before that record (its rank files hold only scheduler and RNG) has one file per rank."""
    first = _rank_file(directory, 0)
    if not first.is_file():
        raise FileNotFoundError(f"{directory} holds no trainer rank state ({first.name} is missing)")
    ranks = torch.load(first, weights_only=False).get("ranks")
    if ranks is None:
        ranks = sum(1 for _ in directory.glob("trainer_rank*.pt"))
    return int(ranks)


def rank_file_to_resume(directory: Path, rank: int, saved_ranks: int) -> Path:
    """The rank file whose scheduler and RNG state rank `rank` of any layout resumes with: its own
    when the saving run had that rank, else that of rank `rank` mod `saved_ranks`."""
    source = _rank_file(directory, rank % saved_ranks)
    if not source.is_file():
        raise FileNotFoundError(f"{directory} is missing {source.name} (the checkpoint was written by "
                                f"{saved_ranks} ranks)")
    return source


def save_trainer_checkpoint(directory: Path, model, optimizer, scheduler, rank: int, trained_only: bool = False) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer, options=_options(trained_only))
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(directory / "dcp"))
    torch.save(
        {"scheduler": scheduler.state_dict(), "rng": torch.get_rng_state(), "ranks": _world_size()},
        _rank_file(directory, rank),
    )


def load_trainer_checkpoint(directory: Path, model, optimizer, scheduler, rank: int, trained_only: bool = False) -> None:
    """Load a checkpoint written by any number of ranks into this rank's model (sharded or whole)
    and optimizer, and its scheduler and RNG state as `rank_file_to_resume` says."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not (directory / "dcp").is_dir():
        raise FileNotFoundError(f"{directory} holds no trainer checkpoint (no dcp/ directory)")
    saved, now = saved_rank_count(directory), _world_size()
    source = rank_file_to_resume(directory, rank, saved)
    options = _options(trained_only)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(directory / "dcp"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
    extra = torch.load(source, weights_only=False)
    scheduler.load_state_dict(extra["scheduler"])
    torch.set_rng_state(extra["rng"])
    if rank == 0 and saved != now:
        logger.info("trainer checkpoint %s was written by %d ranks, loaded on %d: model and optimizer resharded; "
                    "rank r continues the random stream of saving rank r mod %d", directory, saved, now, saved)
