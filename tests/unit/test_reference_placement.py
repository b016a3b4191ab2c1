"""Where the KL term's reference model keeps its fp32 shards (trainer.reference_placement): on the
device when the memory plan fits with them there (auto), else on the host, streamed each forward.
The plan's choice is arithmetic (checked here for GPUs too); the trainer's two layouts compute the
same reference log-probs (2 FSDP ranks on gloo: on a CPU both are host memory, so what differs is
only FSDP's offload policy, which is what the placement sets)."""

from dataclasses import replace

import pytest
import torch.multiprocessing as mp

from rlsys.model.shape import GiB, ModelShape
from rlsys.plan.memory_plan import plan_memory
from tests.helpers import meet, meeting_queue, random_sequences, trainer_spec
from tests.unit.test_memory_plan import PARAMS, _qwen_dir, _recipe


def _plans(tmp_path, gpu_memory, *overrides, on_gpu=True):
    tmp_path.mkdir(parents=True, exist_ok=True)
    model_dir = _qwen_dir(tmp_path, "7b")
    shape = ModelShape.from_model_dir(model_dir)
    return {where: plan_memory(_recipe("gpu_colocated", model_dir, *overrides,
                                       f"trainer.reference_placement={where}"), shape, gpu_memory, on_gpu=on_gpu,
                               flash_attention=True)
            for where in ("auto", "device", "host")}


def test_auto_puts_the_reference_on_the_device_where_the_plan_fits_with_it_there(tmp_path):
    plans = _plans(tmp_path, 80 * GiB)
    auto, device, host = plans["auto"], plans["device"], plans["host"]
    shards = 4 * PARAMS["7b"] // 8  # fp32 over the recipe's 8 ranks
    assert auto.reference_on_device is True and auto.terms == device.terms and auto.fits
    assert auto.terms["reference_on_device"] == shards and host.terms["reference_on_device"] == 0
    # it stays on the device through every phase (a sleep moves the trained state only) ...
    assert {name: auto.phases[name] - host.phases[name] for name in host.phases} == dict.fromkeys(host.phases, shards)
    # ... and leaves the host
    assert auto.host_terms["reference_shards"] == 0 and host.host_terms["reference_shards"] == shards
    assert "reference model: fp32 shards on the device" in auto.table()
    assert "reference model: fp32 shards on the host" in host.table()


def test_auto_keeps_the_reference_on_the_host_where_the_device_has_no_room(tmp_path):
    roomy = _plans(tmp_path / "a", 80 * GiB)["host"]
    tight = roomy.phases["train"] + GiB  # room for the host layout's peak, not for 3.5 GiB more
    plans = _plans(tmp_path / "b", tight)
    assert plans["host"].fits and not plans["device"].fits
    assert plans["auto"].reference_on_device is False and plans["auto"].fits
    assert plans["auto"].terms == plans["host"].terms
    assert any("stay on the host: on the device the peak would be" in note for note in plans["auto"].notes)


def test_on_cpus_auto_is_the_host_and_without_a_kl_term_there_is_nothing_to_place(tmp_path):
    plans = _plans(tmp_path / "cpu", 80 * GiB, on_gpu=False)
    assert plans["auto"].reference_on_device is False and plans["device"].reference_on_device is True
    no_kl = _plans(tmp_path / "nokl", 80 * GiB, "algorithm.use_kl_loss=false", "algorithm.kl_coef=0")
    assert {plan.reference_on_device for plan in no_kl.values()} == {None}
    assert "reference model:" not in no_kl["auto"].table()


def _reference_scenario(rank: int, world: int, queue, model_dir: str, out: str, on_device: bool) -> None:
    import json

    from torch.distributed.fsdp import CPUOffloadPolicy

    from rlsys.actors.trainer import TrainerWorker

    spec = replace(trainer_spec(model_dir, dtype="bfloat16", use_kl_loss=True, kl_coef=0.1),
                   reference_on_device=on_device)
    worker = TrainerWorker(spec, rank, world)
    worker.setup(*meet(rank, world, queue, worker.rendezvous_address))
    sequences = random_sequences(rank, 3, vocab=worker.vocab_size())
    logprobs = worker.compute_log_probs(sequences, reference=True)
    policies = {type(module._get_fsdp_state()._fsdp_param_group.offload_policy) is CPUOffloadPolicy
                for module in worker.ref_model.modules() if hasattr(module, "_get_fsdp_state")
                and module._get_fsdp_state()._fsdp_param_group is not None}
    with open(f"{out}/rank{rank}-{on_device}.json", "w") as file:
        json.dump({"logprobs": logprobs, "streamed_from_host": sorted(policies)}, file)
    worker.shutdown()


@pytest.fixture(scope="module")
def placed(tiny_model_dir, tmp_path_factory):
    import json

    out = tmp_path_factory.mktemp("placement")
    for on_device in (False, True):
        mp.spawn(_reference_scenario, args=(2, meeting_queue(), str(tiny_model_dir), str(out), on_device),
                 nprocs=2, join=True)
    return {on_device: [json.loads((out / f"rank{rank}-{on_device}.json").read_text()) for rank in range(2)]
            for on_device in (False, True)}


def test_the_reference_on_the_device_computes_the_same_log_probs_as_streamed_from_the_host(placed):
    assert [seen["streamed_from_host"] for seen in placed[False]] == [[True], [True]]  # every FSDP group
    assert [seen["streamed_from_host"] for seen in placed[True]] == [[False], [False]]
    for host, device in zip(placed[False], placed[True], strict=True):
        assert host["logprobs"] == device["logprobs"]  # the same bf16 casts of the same fp32 shards


class _Call:
    def __init__(self, function):
        self.function = function

    def remote(self, *args):
        return self.function(*args)


class _Rank:
    """A trainer rank in this process (what `TrainerGroup._judge_model` calls of one)."""

    def __init__(self, spec):
        from rlsys.actors.trainer import TrainerWorker

        self.spec = spec
        self.placed = []
        self.model_report = _Call(lambda: (object(), None))
        self.place_reference = _Call(lambda on_device: (self.placed.append(on_device),
                                                         TrainerWorker.place_reference(self, on_device)))


@pytest.mark.parametrize("plan_says", [True, False, None])
def test_the_group_places_the_reference_where_the_plan_put_it_before_the_ranks_build(monkeypatch, tiny_model_dir,
                                                                                       plan_says):
    """The memory plan (the group's `judge_model`) decides; each rank takes the choice into its spec
    without a reset (rank 0 keeps the port it reserved for the group's store)."""
    from rlsys.actors import group as group_module
    from rlsys.actors.group import TrainerGroup

    monkeypatch.setattr(group_module.ray, "get", lambda refs, **_: refs)
    spec = trainer_spec(tiny_model_dir, dtype="bfloat16", use_kl_loss=True, kl_coef=0.1)
    group = object.__new__(TrainerGroup)
    group.spec, group.failed = spec, False
    group.workers = [_Rank(spec), _Rank(spec)]
    group._judge_model(lambda shape: plan_says)
    assert group.spec.reference_on_device is bool(plan_says)
    for rank in group.workers:
        assert rank.placed == ([True] if plan_says else [])  # False: already the spec's
        assert rank.spec.reference_on_device is bool(plan_says) and rank.spec.model == spec.model
