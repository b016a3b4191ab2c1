"""A trainer checkpoint resumes on another layout than the one that wrote it: 2 FSDP2 ranks -> one
rank (which trains the model whole in fp32, without FSDP) and back, and the resumed ranks go on as
the saving ones do.

Bounds: right after the load the resumed ranks hold exactly the saved state (written again by
their own layout, every tensor of the model and optimizer is bit-equal to the saved one). The step
after it cannot be bit-equal across layouts: the two sides add each gradient's terms in different
orders (another split over ranks and micro-batches, a reduce-scatter or none). So the step is held
to what fp32 promises for two layouts from one state, the bounds of tests/e2e/test_fsdp_equivalence.py
(see its docstring): token-mean metrics within 1e-4, and parameters within Adam's 2 lr per
optimizer step. That the optimizer state came back whole is what the bit-equal rewrite shows: a
lost moment or step count moves the next update by up to lr, inside Adam's bound.
"""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rlsys.actors.inspectable_group import InspectableTrainerGroup
from rlsys.records import TrainSequence
from tests.helpers import random_sequences, trainer_spec

pytestmark = pytest.mark.second_stream  # trainer ranks, no engine set: on the second stream's cluster (Makefile: test)

METRIC_ATOL = 1e-4  # as tests/e2e/test_fsdp_equivalence.py: token means of O(1) values from one state


def _batch(seed: int) -> list[TrainSequence]:
    return random_sequences(seed, count=13, prompt_lens=(2, 6), response_lens=(1, 5), vocab=80)


def _contents(checkpoint: Path) -> dict[str, object]:
    """Every entry of a checkpoint's DCP files as one whole value (tensors at their global shape,
    read in this process, whatever layout wrote them)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(checkpoint / "dcp")).read_metadata().state_dict_metadata
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype) if isinstance(meta, TensorStorageMetadata)
             else None for key, meta in metadata.items()}
    dcp.load(state, checkpoint_id=str(checkpoint / "dcp"))
    return state


def _rank_state(checkpoint: Path, rank: int) -> dict:
    return torch.load(checkpoint / f"trainer_rank{rank}.pt", weights_only=False)


def _resumes_as_the_saver_goes_on(saver: InspectableTrainerGroup, resumer: InspectableTrainerGroup,
                                  batch: list[TrainSequence], checkpoint: Path) -> None:
    checkpoint.mkdir()
    saver.save_checkpoint(str(checkpoint))
    resumer.load_checkpoint(str(checkpoint))

    # the resumed ranks hold exactly the saved model, optimizer, scheduler and RNG streams
    rewritten = checkpoint.with_name(checkpoint.name + "-rewritten")
    rewritten.mkdir()
    resumer.save_checkpoint(str(rewritten))
    saved, again = _contents(checkpoint), _contents(rewritten)
    assert saved.keys() == again.keys()
    assert {key.rsplit(".", 1)[1] for key in saved if key.startswith("optim.state.")} == {"exp_avg", "exp_avg_sq",
                                                                                         "step"}
    for key, value in saved.items():
        assert torch.equal(value, again[key]) if isinstance(value, torch.Tensor) else value == again[key], key
    for rank in range(resumer.num_ranks):  # rank r continues saving rank r mod N's stream
        ours, theirs = _rank_state(rewritten, rank), _rank_state(checkpoint, rank % saver.num_ranks)
        assert ours["ranks"] == resumer.num_ranks and theirs["ranks"] == saver.num_ranks
        assert ours["scheduler"] == theirs["scheduler"] and torch.equal(ours["rng"], theirs["rng"])
    before = saver.full_state_dict()
    resumed = resumer.full_state_dict()
    assert before.keys() == resumed.keys() and all(torch.equal(before[k], resumed[k]) for k in before)

    going_on, resumed_step = saver.train_step(batch), resumer.train_step(batch)
    for metric in ("loss", "entropy", "grad_norm"):
        assert resumed_step[metric] == pytest.approx(going_on[metric], abs=METRIC_ATOL), metric
    assert resumed_step["train_tokens"] == going_on["train_tokens"]
    assert resumed_step["lr"] == going_on["lr"]  # the schedule's position came back
    spec = saver.spec.trainer
    adam_bound = 2 * spec.lr * spec.mini_batches_per_step
    params_a, params_b = saver.full_state_dict(), resumer.full_state_dict()
    worst = max((params_a[k] - params_b[k]).abs().max().item() for k in params_a)
    assert worst <= adam_bound, f"parameters differ by {worst} > {adam_bound}"
    assert max((params_a[k] - before[k]).abs().max().item() for k in params_a) > going_on["lr"] / 2  # a real step


def test_a_checkpoint_resumes_on_other_rank_counts_and_context_parallel_sizes_as_the_run_would_have_gone_on(
        warm_trainer_groups, tiny_model_dir, tmp_path):
    """2 FSDP2 ranks train two steps and save; one fresh rank (the whole model, no FSDP) loads it and
    takes step 3 as the two ranks do; the one rank saves and 2 ranks sharing each sequence (context
    parallel size 2) load that and take step 4 alike (a rank the saving run did not have continues
    rank 0's scheduler and RNG); they save and 2 data-parallel ranks (CP 1) load it and take step 5."""
    # packed micro-batches, two optimizer steps per step, a warming-up cosine schedule, the entropy
    # term; no KL term: its reference model is model.path's, never in a checkpoint, and would cost a
    # second model on every rank
    spec = trainer_spec(tiny_model_dir, lr=1e-3, max_tokens_per_microbatch=24, mini_batches_per_step=2,
                        lr_schedule="cosine", warmup_steps=2, total_steps=6, entropy_coef=0.01)
    context_parallel = replace(spec, trainer=spec.trainer.model_copy(update={"num_ranks": 2,
                                                                            "context_parallel_size": 2}))
    two, one, cp_two = warm_trainer_groups((spec, 2), (spec, 1), (context_parallel, 2))
    assert (two.describe()["layout"], one.describe()["layout"]) == ("FSDP2", "whole model")
    for step in range(2):
        two.train_step(_batch(step))
    _resumes_as_the_saver_goes_on(two, one, _batch(2), tmp_path / "two-to-one")
    _resumes_as_the_saver_goes_on(one, cp_two, _batch(3), tmp_path / "one-to-cp-two")
    _resumes_as_the_saver_goes_on(cp_two, two, _batch(4), tmp_path / "cp-two-to-two")
