"""A trainer checkpoint's per-rank files do not pin the rank count: a rank the saving run did not
have resumes from the state of rank r mod N, and checkpoints written before the rank count was
recorded (one file per rank, scheduler and RNG only) still load on any rank count."""

from pathlib import Path

import pytest
import torch

from rlsys.actors.checkpoint import (
    load_trainer_checkpoint,
    rank_file_to_resume,
    save_trainer_checkpoint,
    saved_rank_count,
)


def _trainer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return model, optimizer, scheduler


def _train(model, optimizer, scheduler, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(5, 4)).square().mean().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def _saved(directory: Path):
    """A checkpoint of a trained model written by one rank (no process group: a world of one)."""
    model, optimizer, scheduler = _trainer(seed=0)
    _train(model, optimizer, scheduler, steps=3)
    directory.mkdir()
    save_trainer_checkpoint(directory, model, optimizer, scheduler, rank=0)
    return model, optimizer, scheduler, torch.get_rng_state()


def test_a_rank_the_saving_run_did_not_have_resumes_with_the_state_of_rank_r_mod_n(tmp_path):
    model, optimizer, scheduler, rng = _saved(tmp_path / "ckpt")
    assert saved_rank_count(tmp_path / "ckpt") == 1
    torch.rand(100)  # the RNG moves on after the save

    fresh_model, fresh_optimizer, fresh_scheduler = _trainer(seed=1)
    load_trainer_checkpoint(tmp_path / "ckpt", fresh_model, fresh_optimizer, fresh_scheduler, rank=1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True))
    for saved, loaded in zip(optimizer.state.values(), fresh_optimizer.state.values(), strict=True):
        assert saved.keys() == loaded.keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(saved[key], loaded[key]) for key in saved)
    assert fresh_scheduler.state_dict() == scheduler.state_dict()
    assert fresh_scheduler.get_last_lr() == scheduler.get_last_lr() == [1e-2 / 4]
    assert torch.equal(torch.get_rng_state(), rng)  # rank 1 continues rank 0's stream (1 mod 1 = 0)


def test_a_checkpoint_without_the_rank_count_still_loads_on_any_rank_count(tmp_path):
    """The format before the rank count was recorded: `trainer_rank{r}.pt` holds {scheduler, rng}."""
    directory = tmp_path / "ckpt"
    _, _, scheduler, _ = _saved(directory)
    streams = [torch.Generator().manual_seed(rank).get_state() for rank in range(2)]
    for rank, stream in enumerate(streams):  # as a 2-rank run wrote them
        torch.save({"scheduler": scheduler.state_dict(), "rng": stream}, directory / f"trainer_rank{rank}.pt")

    assert saved_rank_count(directory) == 2
    assert [rank_file_to_resume(directory, rank, 2).name for rank in range(4)] == [
        "trainer_rank0.pt", "trainer_rank1.pt", "trainer_rank0.pt", "trainer_rank1.pt"]
    for rank in (0, 3):
        model, optimizer, fresh_scheduler = _trainer(seed=1)
        load_trainer_checkpoint(directory, model, optimizer, fresh_scheduler, rank=rank)
        assert torch.equal(torch.get_rng_state(), streams[rank % 2])
        assert fresh_scheduler.state_dict() == scheduler.state_dict()


def test_a_checkpoint_missing_a_rank_file_it_needs_is_refused_naming_the_file(tmp_path):
    directory = tmp_path / "ckpt"
    _saved(directory)
    state = torch.load(directory / "trainer_rank0.pt", weights_only=False)
    torch.save({**state, "ranks": 2}, directory / "trainer_rank0.pt")  # a 2-rank checkpoint, rank 1's file lost
    model, optimizer, scheduler = _trainer(seed=1)
    with pytest.raises(FileNotFoundError, match=r"ckpt is missing trainer_rank1.pt \(the checkpoint was written "
                                                r"by 2 ranks\)"):
        load_trainer_checkpoint(directory, model, optimizer, scheduler, rank=3)
    (directory / "trainer_rank0.pt").unlink()
    with pytest.raises(FileNotFoundError, match="holds no trainer rank state"):
        load_trainer_checkpoint(directory, model, optimizer, scheduler, rank=0)
