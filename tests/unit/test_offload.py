"""The trainer's sleep/wake_up offload (actors/offload.py): one host arena of exactly the bytes
moved (each storage's copy at a 64-byte boundary), page-locked in place and kept across cycles on
a GPU host, freed at wake_up on a CPU host; the state comes back bit for bit. The page-locking
calls themselves need CUDA: here a recording locker stands in for cudaHostRegister, and the real
one is checked against a fake CUDA runtime for the calls it makes."""

import gc
import weakref

import pytest
import torch

from rlsys.actors.offload import (
    ALIGNMENT,
    CudaHostRegister,
    StateOffloader,
    arena_layout,
    page_lock,
    page_locker,
    state_bytes_after_a_step,
    trainer_state_tensors,
)


class RecordingLocker:
    """Stands in for cudaHostRegister / cudaHostUnregister: what was locked, in order."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.locked: dict[int, int] = {}  # ptr -> bytes, currently locked

    def lock(self, ptr: int, nbytes: int) -> None:
        assert ptr not in self.locked, "locked twice"
        self.calls.append(("lock", ptr, nbytes))
        self.locked[ptr] = nbytes

    def unlock(self, ptr: int) -> None:
        assert ptr in self.locked, "unlocked what was never locked"
        self.calls.append(("unlock", ptr))
        del self.locked[ptr]


def _trained_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Linear(13, 3, bias=False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 7)).square().sum().backward()
    optimizer.step()
    return model, optimizer


def _snapshot(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tensors]


def _storage_bytes(tensors: list[torch.Tensor]) -> list[int]:
    seen, sizes = set(), []
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen and storage.nbytes():
            seen.add(storage.data_ptr())
            sizes.append(storage.nbytes())
    return sizes


def test_arena_layout_packs_each_copy_on_a_64_byte_boundary_and_sums_them():
    offsets, total = arena_layout([100, 1000, 3, 64])
    assert offsets == [0, 128, 1152, 1216]
    assert total == 128 + 1024 + 64 + 64 == 1280  # not rounded up to a power of two (2048)
    assert ALIGNMENT == 64


@pytest.mark.parametrize("keep_arena", [False, True])
def test_sleep_then_wake_up_restores_parameters_gradients_and_moments_bit_for_bit(keep_arena):
    model, optimizer = _trained_model()
    tensors = trainer_state_tensors(model, optimizer)
    assert any(p.grad is not None for p in model.parameters()) and optimizer.state
    before = _snapshot(tensors)
    offloader = StateOffloader(pin_memory=False, keep_arena=keep_arena, locker=RecordingLocker())
    slept = offloader.sleep(tensors)
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)  # the "device" copies are gone
    assert offloader.asleep and slept.bytes == sum(_storage_bytes(before))
    woke = offloader.wake_up()
    assert woke.bytes == slept.bytes and not offloader.asleep
    for restored, original in zip(tensors, before, strict=True):
        assert torch.equal(restored, original) and restored.dtype == original.dtype
    # the same objects train on: FSDP's and the optimizer's references stayed valid
    optimizer.step()


def test_a_gpu_hosts_arena_is_exactly_the_aligned_bytes_moved_and_page_locked_once():
    model, optimizer = _trained_model()
    tensors = trainer_state_tensors(model, optimizer)
    sizes = _storage_bytes(tensors)
    locker = RecordingLocker()
    offloader = StateOffloader(pin_memory=True, locker=locker)  # keeps its arena, as on a GPU host
    assert offloader.keep_arena
    slept = offloader.sleep(tensors)
    expected = sum(-(-size // 64) * 64 for size in sizes)
    assert slept.host_bytes == expected == arena_layout(sizes)[1]
    assert 0 <= expected - slept.bytes < ALIGNMENT * len(sizes)  # under 64 bytes a storage, not a power of two
    arena = offloader._arena.buffer
    assert locker.calls == [("lock", arena.data_ptr(), expected)]  # one registration, of the arena itself
    assert offloader.wake_up().host_bytes == expected  # kept for the next cycle


def test_a_kept_arena_is_reused_across_cycles_without_a_new_allocation_or_registration():
    model, optimizer = _trained_model()
    tensors = trainer_state_tensors(model, optimizer)
    before = _snapshot(tensors)
    locker = RecordingLocker()
    offloader = StateOffloader(pin_memory=True, locker=locker)
    reports = []
    pointers = []
    for _ in range(3):
        reports.append(offloader.sleep(tensors))
        pointers.append(offloader._arena.buffer.data_ptr())
        offloader.wake_up()
    assert len(set(pointers)) == 1
    assert [call[0] for call in locker.calls] == ["lock"]
    assert len({r.host_bytes for r in reports}) == 1
    for restored, original in zip(tensors, before, strict=True):
        assert torch.equal(restored, original)


@pytest.mark.parametrize("fused", [True, False])
def test_the_arena_prepared_at_setup_is_the_one_the_first_sleep_uses(fused):
    """A GPU host's arena is allocated and page-locked when the rank is built, before AdamW has any
    state: its size, computed then, is exactly what the first sleep after a step moves, so that
    sleep neither allocates nor registers anything (the first sleep was 10-15 s on an H200)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Linear(13, 3, bias=False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    predicted = state_bytes_after_a_step(model, optimizer)
    locker = RecordingLocker()
    offloader = StateOffloader(pin_memory=True, locker=locker)
    offloader.prepare(predicted)
    assert [call[0] for call in locker.calls] == ["lock"] and offloader.host_bytes == predicted
    prepared = offloader._arena.buffer.data_ptr()

    model(torch.randn(5, 7)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)  # as train_step leaves it
    assert state_bytes_after_a_step(model, optimizer) == predicted  # now counted from the real state
    tensors = trainer_state_tensors(model, optimizer)
    needed = arena_layout([t.untyped_storage().nbytes() for t in tensors])[1]
    slept = offloader.sleep(tensors)
    assert offloader._arena.buffer.data_ptr() == prepared and [call[0] for call in locker.calls] == ["lock"]
    assert slept.host_bytes == predicted == needed
    offloader.wake_up()


def test_a_cpu_host_prepares_nothing():
    model, optimizer = _trained_model()
    offloader = StateOffloader(pin_memory=False)
    assert offloader.prepare(state_bytes_after_a_step(model, optimizer)) == 0.0 and offloader.host_bytes == 0


def test_the_arena_grows_when_a_new_storage_appears_and_the_old_one_is_unregistered_first():
    """The first sleep may come before the first step, when AdamW has no moments yet."""
    torch.manual_seed(0)
    model = torch.nn.Linear(9, 11)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    locker = RecordingLocker()
    offloader = StateOffloader(pin_memory=True, locker=locker)
    first = offloader.sleep(trainer_state_tensors(model, optimizer))
    old_ptr = offloader._arena.buffer.data_ptr()
    offloader.wake_up()
    model(torch.randn(4, 9)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)  # as train_step ends
    tensors = trainer_state_tensors(model, optimizer)
    before = _snapshot(tensors)
    second = offloader.sleep(tensors)
    assert second.host_bytes == arena_layout(_storage_bytes(before))[1] > first.host_bytes
    new_ptr = offloader._arena.buffer.data_ptr()
    assert locker.calls[1:] == [("unlock", old_ptr), ("lock", new_ptr, second.host_bytes)]
    offloader.wake_up()
    for restored, original in zip(tensors, before, strict=True):
        assert torch.equal(restored, original)
    offloader.release()
    assert locker.locked == {} and offloader.host_bytes == 0


def test_a_cpu_hosts_copies_are_freed_at_wake_up_and_nothing_is_page_locked():
    model, optimizer = _trained_model()
    tensors = trainer_state_tensors(model, optimizer)
    sizes = _storage_bytes(tensors)
    offloader = StateOffloader(pin_memory=False)
    assert offloader.locker is None and not offloader.keep_arena
    assert offloader.sleep(tensors).host_bytes == arena_layout(sizes)[1]  # while asleep: the state, once
    assert offloader.wake_up().host_bytes == 0 and offloader._arena is None


def test_sleeping_twice_or_releasing_while_asleep_is_refused():
    model, optimizer = _trained_model()
    offloader = StateOffloader(pin_memory=True, locker=RecordingLocker())
    offloader.sleep(trainer_state_tensors(model, optimizer))
    with pytest.raises(RuntimeError, match="twice"):
        offloader.sleep(trainer_state_tensors(model, optimizer))
    with pytest.raises(RuntimeError, match="asleep"):
        offloader.release()


def test_the_page_locking_decision_registers_memory_with_cuda_on_gpu_hosts_only():
    assert isinstance(page_locker(True), CudaHostRegister)
    assert page_locker(False) is None
    assert isinstance(StateOffloader(pin_memory=True).locker, CudaHostRegister)
    assert StateOffloader(pin_memory=False).locker is None


def test_cuda_host_register_calls_the_cuda_runtime_with_the_exact_bytes(monkeypatch):
    """What CudaHostRegister asks of torch.cuda.cudart() (the real runtime needs a GPU): register
    the pointer and size with flag 0 (cudaHostRegisterDefault), unregister by pointer, and an
    error code becomes an error naming the call."""
    calls = []

    class FakeCudart:
        def cudaHostRegister(self, ptr, nbytes, flags):
            calls.append(("register", ptr, nbytes, flags))
            return 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

        def cudaGetErrorString(self, error):
            return "out of memory"

    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    buffer = torch.empty(1000, dtype=torch.uint8)
    ptr = buffer.data_ptr()
    unlock = page_lock(buffer, CudaHostRegister())
    assert calls == [("register", ptr, 1000, 0)]
    del buffer
    gc.collect()
    assert calls[-1] == ("unregister", ptr) and not unlock.alive  # freed storage: unregistered first

    monkeypatch.setattr(FakeCudart, "cudaHostRegister", lambda self, ptr, nbytes, flags: 2)
    with pytest.raises(RuntimeError, match="cudaHostRegister of 0.00 GiB failed: out of memory"):
        CudaHostRegister().lock(ptr, 1000)


def test_page_lock_registers_a_views_whole_storage_until_the_last_view_is_gone():
    locker = RecordingLocker()
    flat = torch.zeros(256)
    shard = flat.narrow(0, 0, 100)  # as FSDP's local tensor is a view of its padded flat shard
    page_lock(shard, locker)
    assert locker.calls == [("lock", flat.data_ptr(), 256 * 4)]
    del flat
    gc.collect()
    assert locker.locked  # the view keeps the storage, and its registration, alive
    del shard
    gc.collect()
    assert locker.locked == {}


def _reference_scenario(rank: int, world: int, queue, model_dir: str, out: str) -> None:
    """A trainer rank with a reference model, as on a GPU host as far as page-locking goes (a
    recording locker stands in for cudaHostRegister)."""
    import json
    import math

    import rlsys.actors.offload as offload_module
    import rlsys.actors.trainer_models as models_module
    from rlsys.actors.trainer import TrainerWorker
    from tests.helpers import meet, random_sequences, trainer_spec

    locker = RecordingLocker()
    offload_module.page_locker = lambda pin_memory: locker
    pin_host_shards = models_module.pin_host_shards
    models_module.pin_host_shards = lambda model, pin_memory: pin_host_shards(model, True)
    worker = TrainerWorker(trainer_spec(model_dir, use_kl_loss=True, kl_coef=0.1), rank, world)
    worker.setup(*meet(rank, world, queue, worker.rendezvous_address))

    def shard_storages() -> dict[int, int]:
        return {p.to_local().untyped_storage().data_ptr(): p.to_local().untyped_storage().nbytes()
                for p in worker.ref_model.parameters()}

    loaded = shard_storages()
    worker.compute_sequence_kl(random_sequences(rank, 2, vocab=worker.vocab_size()))  # FSDP's lazy init, forwards
    padded = sum(math.ceil(p.shape[0] / world) * math.prod(p.shape[1:]) * 4 for p in worker.ref_model.parameters())
    local = sum(p.to_local().numel() * 4 for p in worker.ref_model.parameters())
    with open(f"{out}/rank{rank}.json", "w") as file:
        json.dump({"locked": sorted(locker.locked.items()), "loaded": sorted(loaded.items()),
                   "after_forward": sorted(shard_storages().items()), "padded_bytes": padded,
                   "local_bytes": local}, file)
    worker.shutdown()


def test_the_reference_models_host_shards_are_page_locked_in_place_at_their_padded_bytes(tmp_path):
    """2 ranks on gloo, a tiny model whose MLP is 129 wide: gate and up have 129 rows, padded to 65
    a rank (the memory plan's dim-0 padding). Every shard FSDP streams the reference from is locked
    once, in place (no copy into torch's caching host allocator), and its forwards keep using it."""
    import json

    import torch.multiprocessing as mp

    from rlsys.tools.tiny_model import TinyModelSpec, make_tiny_model
    from tests.helpers import meeting_queue

    model_dir = make_tiny_model(tmp_path / "model", TinyModelSpec(intermediate_size=129))
    mp.spawn(_reference_scenario, args=(2, meeting_queue(), str(model_dir), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["locked"] == seen["loaded"] == seen["after_forward"]
        assert sum(nbytes for _, nbytes in seen["locked"]) == seen["padded_bytes"]
    last = json.loads((tmp_path / "rank1.json").read_text())
    assert last["local_bytes"] < last["padded_bytes"]  # 64 of gate's and up's 129 rows, in 65-row shards


def test_a_cpu_hosts_arena_is_freed_by_its_release_not_later():
    """Nothing of wake_up keeps a view of the arena past its release (the trim after it would miss
    the arena's pages: the RSS of every CPU rank would grow by its state)."""
    model, optimizer = _trained_model()
    offloader = StateOffloader(pin_memory=False)
    offloader.sleep(trainer_state_tensors(model, optimizer))
    storage = offloader._arena.buffer.untyped_storage()
    freed = []
    weakref.finalize(storage, freed.append, True)
    del storage
    released = offloader.release

    def release_and_check():
        released()
        gc.collect()
        assert freed, "the arena outlived its release"

    offloader.release = release_and_check
    offloader.wake_up()
    assert freed
