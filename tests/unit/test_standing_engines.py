"""Standing engines without Ray: what a run must share with the engines it attaches to, and the
lease that keeps a second run (and a dead run's lease) off them."""

import json
import shutil

import pytest

from rlsys.config import EngineConfig, ModelConfig
from rlsys.rollout.sglang.server import ServerSpec
from rlsys.rollout.standing import EngineIdentity, EngineService, LeaseHolder
from rlsys.system.topology import Topology


def _identity(model_dir, topology=None, **engine) -> EngineIdentity:
    spec = ServerSpec(ModelConfig(path=str(model_dir)), EngineConfig(**engine), memory_saver=True)
    return EngineIdentity.of(spec, topology or Topology("colocated", 2, 1, 1, has_gpu=False, trainers_sleep=False))


def test_a_run_on_the_same_model_and_placement_matches(tiny_model_dir):
    assert _identity(tiny_model_dir).differences(_identity(tiny_model_dir)) == []


def test_fields_that_only_drew_the_first_weights_are_not_compared(tiny_model_dir, tmp_path):
    other = tmp_path / "model"
    shutil.copytree(tiny_model_dir, other)
    config = json.loads((other / "config.json").read_text())
    config.update(initializer_range=0.1, _name_or_path="elsewhere", transformers_version="0.0")
    (other / "config.json").write_text(json.dumps(config))
    assert _identity(tiny_model_dir).differences(_identity(other)) == []


def test_each_difference_is_named(tiny_model_dir, tmp_path):
    other = tmp_path / "model"
    shutil.copytree(tiny_model_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["hidden_size"] = 128
    (other / "config.json").write_text(json.dumps(config))
    (other / "tokenizer.json").write_text((other / "tokenizer.json").read_text().replace('"a"', '"A"', 1)
                                          if (other / "tokenizer.json").exists() else "{}")
    engines = _identity(tiny_model_dir)
    run = _identity(other, Topology("disaggregated", 1, 1, 1, has_gpu=False, trainers_sleep=False),
                    context_length=128, extra_args=["--dtype", "bfloat16"])
    lines = engines.differences(run)
    assert "model config.json hidden_size: the engines' 64, the run's 128" in lines
    assert "the tokenizer's files differ (model.tokenizer_path or model.path)" in lines
    assert "rollout.engine.context_length: the engines' 512, the run's 128" in lines
    assert "rollout.engine.extra_args: the engines' (), the run's ('--dtype', 'bfloat16')" in lines
    assert "placement.mode: the engines' 'colocated', the run's 'disaggregated'" in lines
    assert "trainer.num_ranks (the trainer bundles of the engines' placement): the engines' 2, the run's 1" in lines
    # `rlsys eval` places no trainer: only what the engines compute counts
    assert not any("placement" in line or "num_ranks" in line for line in engines.differences(run, placement=False))


def test_a_gpu_run_that_hands_the_device_over_needs_the_memory_saver(tiny_model_dir):
    gpu = Topology("colocated", 1, 1, 1, has_gpu=True, trainers_sleep=True)
    model = ModelConfig(path=str(tiny_model_dir))
    without = EngineIdentity.of(ServerSpec(model, EngineConfig(), has_gpu=True, memory_saver=False), gpu)
    run = EngineIdentity.of(ServerSpec(model, EngineConfig(), has_gpu=True, memory_saver=True), gpu)
    assert any("memory saver" in line for line in without.differences(run))
    assert run.differences(without) == []  # engines with it serve a run that never releases them


def test_one_lease_at_a_time_and_a_lease_not_renewed_lapses(monkeypatch):
    import rlsys.rollout.standing as standing

    now = [1000.0]
    monkeypatch.setattr(standing.time, "monotonic", lambda: now[0])
    keeper = EngineService(record=None)
    first = LeaseHolder("/runs/a", "node-1", 11, "train")
    lease_id, refusal = keeper.acquire(first, ttl_s=30)
    assert lease_id and refusal is None
    second_id, refusal = keeper.acquire(LeaseHolder("/runs/b", "node-2", 22, "train"), ttl_s=30)
    assert second_id is None and refusal["holder"]["run_dir"] == "/runs/a"
    assert refusal["description"] == "`rlsys train` pid 11 on node-1 (run_dir /runs/a)"
    now[0] += 25
    assert keeper.renew(lease_id, 30) and not keeper.renew("another", 30)
    now[0] += 29  # renewed 29 s ago: still held
    assert keeper.acquire(LeaseHolder("/runs/b", "node-2", 22, "train"), 30)[0] is None
    now[0] += 2  # not renewed for 31 s: lapsed, the next run takes it
    assert keeper.lease() is None and not keeper.renew(lease_id, 30)
    third_id, _ = keeper.acquire(LeaseHolder("/runs/b", "node-2", 22, "eval"), 30)
    assert third_id and not keeper.release(lease_id) and keeper.release(third_id) and keeper.lease() is None


def test_a_lease_whose_holder_was_killed_is_taken_over_at_once_and_a_live_ones_never():
    """A run killed with SIGKILL never releases its lease; the next run on its host sees that its
    process is gone (pid and start time, same pid namespace) and takes the lease over, instead of
    waiting LEASE_TTL_S for it to lapse. A holder alive, or on another host, keeps it."""
    import dataclasses
    import subprocess
    import sys

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    me = LeaseHolder.this_process("/runs/me", "train")
    killed = dataclasses.replace(me, run_dir="/runs/killed", pid=ended.pid)
    assert killed.is_gone() and not me.is_gone()
    assert dataclasses.replace(me, started=me.started - 5).is_gone()  # the pid reused by a later process
    assert not dataclasses.replace(killed, host="another-host").is_gone()  # cannot be told from here
    assert not dataclasses.replace(killed, pid_namespace=me.pid_namespace + 1).is_gone()
    assert not dataclasses.replace(killed, pid_namespace=0).is_gone()  # a holder that did not say

    keeper = EngineService(record=None)
    held, _ = keeper.acquire(killed, ttl_s=30)
    refused, current = keeper.take_over(me, 30, gone=dataclasses.replace(killed, pid=1))  # not the holder
    assert refused is None and current["holder"]["run_dir"] == "/runs/killed"
    assert LeaseHolder(**current["holder"]) == killed  # what Lease.take rebuilds and hands back
    taken, _ = keeper.take_over(me, 30, gone=killed)
    assert taken and keeper.lease()["holder"]["run_dir"] == "/runs/me" and not keeper.renew(held, 30)


@pytest.mark.parametrize("name", ["a/b", "-x", ""])
def test_a_set_name_ray_cannot_hold_is_refused(name, capsys):
    from rlsys.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["engines", "up", "configs/quickstart.yaml", "--name", name])
    assert exit_.value.code == 2
    assert "--name" in capsys.readouterr().err


def test_kept_trainer_ranks_are_reused_only_by_a_run_whose_ranks_would_start_the_same_way():
    """actors/warm_ranks.py: a set's kept ranks are taken by a run only if its ranks would start as
    they did (slots, device kind, environment, code); `engines up --no-warm-trainers` keeps none."""
    from rlsys.actors.warm_ranks import WarmIdentity, code_fingerprint
    from rlsys.cli import build_parser

    kept = WarmIdentity.of(2, False, {"NCCL_DEBUG": "WARN", "OMP_NUM_THREADS": "1"})
    assert WarmIdentity.of(2, False, {"OMP_NUM_THREADS": "1", "NCCL_DEBUG": "WARN"}) == kept  # order is no difference
    for other in (WarmIdentity.of(1, False, {"NCCL_DEBUG": "WARN", "OMP_NUM_THREADS": "1"}),
                  WarmIdentity.of(2, True, {"NCCL_DEBUG": "WARN", "OMP_NUM_THREADS": "1"}),
                  WarmIdentity.of(2, False, {"NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "1"})):
        assert other != kept
    assert code_fingerprint() == kept.code and len(kept.code) == 32
    assert build_parser().parse_args(["engines", "up", "c.yaml"]).warm_trainers is True
    assert build_parser().parse_args(["engines", "up", "c.yaml", "--no-warm-trainers"]).warm_trainers is False
