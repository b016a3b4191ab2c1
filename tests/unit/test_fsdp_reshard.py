"""Nothing of a trainer stays gathered, or staged, into the engines' turn (2 FSDP2 ranks on gloo).

FSDP2 keeps a root's parameters gathered after a forward until the backward (torch's
FSDPState._lazy_init): after a forward with no backward (log-probs, the reference model's every
forward) they would stay on the device for good. A sharded parameter is registered on its module
as a DTensor, a gathered one as a plain tensor, so "every parameter is a DTensor" is "every FSDP
group is sharded". One scenario runs once in two spawned processes (no Ray); each test reads one of
its observations.
"""

import json

import pytest
import torch.multiprocessing as mp

from tests.helpers import meet, meeting_queue, random_sequences, trainer_spec

BUCKET_BYTES = 1024  # far below the embedding's size: the largest tensor travels alone


class _SilentEngine:
    """The colocated transport's endpoints, accepting every bucket (the trainer's side is under test)."""

    def begin_weight_update(self) -> None: ...

    def update_weights_from_tensor(self, serialized_named_tensors, load_format, flush_cache=False,
                                   weight_version=None) -> None: ...

    def end_weight_update(self) -> None: ...


def _gathered(model) -> list[str]:
    from torch.distributed.tensor import DTensor

    return [name for name, param in model.named_parameters() if not isinstance(param, DTensor)]


def _scenario(rank: int, world: int, queue, model_dir: str, out: str) -> None:
    from rlsys.actors.trainer import TrainerWorker
    from rlsys.weight_sync.colocated import ColocatedWeightSender
    from rlsys.weight_sync.sync import staging_buffer_bytes

    spec = trainer_spec(model_dir, use_kl_loss=True, kl_coef=0.1, mini_batches_per_step=2)
    worker = TrainerWorker(spec, rank, world)
    worker.setup(*meet(rank, world, queue, worker.rendezvous_address))
    sequences = random_sequences(rank, 4, vocab=worker.vocab_size())
    seen = {}
    worker.compute_log_probs(sequences)
    seen["policy after compute_log_probs"] = _gathered(worker.model)
    worker.compute_sequence_kl(sequences)
    seen["policy after compute_sequence_kl"] = _gathered(worker.model)
    seen["reference after compute_sequence_kl"] = _gathered(worker.ref_model)
    worker.train_step([sequences[:2], sequences[2:]])  # old and reference log-probs, then backward
    seen["policy after train_step"] = _gathered(worker.model)
    seen["reference after train_step"] = _gathered(worker.ref_model)
    # Rank 0 feeds the only engine; rank 1 sends it its shards.
    worker.gather_dst = 0
    worker.weights_out.transport = ColocatedWeightSender(_SilentEngine()) if rank == 0 else None
    worker.sync_weights(BUCKET_BYTES, weight_version=1)
    if rank == 0:
        seen["staging bytes after sync"] = worker.weights_out.transport.staging_nbytes
        seen["staging bytes planned"] = staging_buffer_bytes(worker.model.named_parameters(), BUCKET_BYTES)
        seen["largest parameter bytes"] = max(p.numel() * p.element_size() for p in worker.model.parameters())
    worker.sleep()
    if rank == 0:
        seen["staging bytes asleep"] = worker.weights_out.transport.staging_nbytes
    worker.wake_up()
    with open(f"{out}/rank{rank}.json", "w") as file:
        json.dump(seen, file)
    worker.shutdown()


@pytest.fixture(scope="module")
def observed(tiny_model_dir, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("reshard")
    mp.spawn(_scenario, args=(2, meeting_queue(), str(tiny_model_dir), str(out)), nprocs=2, join=True)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("what", ["policy after compute_log_probs", "policy after compute_sequence_kl",
                                  "policy after train_step"])
def test_the_policy_is_sharded_again_after_every_pass(observed, what):
    assert [ranks[what] for ranks in observed] == [[], []]


@pytest.mark.parametrize("what", ["reference after compute_sequence_kl", "reference after train_step"])
def test_the_reference_root_is_sharded_again_after_its_forwards(observed, what):
    assert [ranks[what] for ranks in observed] == [[], []]


def test_the_staging_buffer_is_the_largest_bucket_as_planned_not_the_bucket_size(observed):
    rank0 = observed[0]
    assert rank0["staging bytes after sync"] == rank0["staging bytes planned"]
    assert rank0["staging bytes planned"] >= rank0["largest parameter bytes"] > BUCKET_BYTES


def test_a_sleeping_trainer_holds_no_staging_buffer(observed):
    assert observed[0]["staging bytes after sync"] > 0
    assert observed[0]["staging bytes asleep"] == 0
