"""Weight sync into real SGLang servers, both transports: afterwards each engine computes what
the trainer computes (fp32 log-probs of fixed sequences) and reports the new weight version."""

import random
import socket

import pytest

from rlsys.actors.group import TrainerGroup
from rlsys.config import EngineConfig, ModelConfig
from rlsys.records import SamplingParams, TrainSequence
from rlsys.rollout.manager import RolloutManager
from rlsys.rollout.sglang.client import EngineAddress
from rlsys.rollout.sglang.server import ServerSpec
from rlsys.run.verify import WeightSyncMismatch, verify_engine_weights
from rlsys.system.topology import Topology
from tests.helpers import trainer_spec

FIXED = [[5, 9, 14, 3, 7, 7, 20, 31], [40, 41, 42, 6, 6, 6], [12, 65, 13, 65, 14, 73, 15, 1]]


def _batch(seed: int) -> list[TrainSequence]:
    rng = random.Random(seed)
    return [
        TrainSequence([rng.randrange(3, 80) for _ in range(8)], prompt_len=4, advantage=rng.choice([-1.0, 1.0]))
        for _ in range(16)
    ]


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for row_a, row_b in zip(a, b, strict=True) for x, y in zip(row_a, row_b, strict=True))


def _topology(mode: str, engines: list[EngineAddress], num_ranks: int = 2) -> Topology:
    return Topology(mode, num_ranks, len(engines), 1, has_gpu=False, trainers_sleep=False).with_engines(engines)


def _engines_match_trainer(rollout, trainer) -> list[float]:
    expected = trainer.compute_log_probs([TrainSequence(tokens, prompt_len=1) for tokens in FIXED])
    return [_max_diff(rollout.fleet.score(FIXED, engine_index=i), expected) for i in range(len(rollout.fleet.engines))]


@pytest.fixture(scope="module")
def two_engines_two_ranks(ray_cluster, tiny_model_dir, tmp_path_factory):
    engine = EngineConfig(skip_tokenizer_init=True, context_length=64, max_total_tokens=4096, request_timeout_s=120)
    spec = ServerSpec(ModelConfig(path=str(tiny_model_dir)), engine)
    rollout = RolloutManager.start(spec, 2, str(tmp_path_factory.mktemp("logs")), [{"num_cpus": 1}] * 2)
    trainer = TrainerGroup(trainer_spec(tiny_model_dir, lr=1e-2), num_ranks=2)
    rollout.fleet.wait_ready()
    yield rollout, trainer
    rollout.shutdown()
    trainer.shutdown()


def test_colocated_sync_puts_trainer_weights_on_every_engine(two_engines_two_ranks):
    rollout, trainer = two_engines_two_ranks
    assert max(_engines_match_trainer(rollout, trainer)) < 1e-3  # same initial weights
    assert rollout.fleet.weight_versions() == [0, 0]

    trainer.train_step(_batch(0))
    assert min(_engines_match_trainer(rollout, trainer)) > 1e-2  # engines still hold the old weights
    with pytest.raises(WeightSyncMismatch, match="weight versions"):
        verify_engine_weights(trainer, rollout.fleet, 1, 1e-3, seed=0)

    trainer.connect_engines(_topology("colocated", rollout.fleet.addresses), timeout_s=60)  # rank i -> engine i
    trainer.sync_weights(16 * 2**20, weight_version=1)
    assert max(_engines_match_trainer(rollout, trainer)) < 1e-3
    assert rollout.fleet.weight_versions() == [1, 1]
    assert verify_engine_weights(trainer, rollout.fleet, 1, 1e-3, seed=0) < 1e-3
    generations = rollout.generate([FIXED[0][:3], FIXED[1][:3]], SamplingParams(max_new_tokens=6, ignore_eos=True), n=2)
    assert [g.weight_version for g in generations] == [1, 1, 1, 1]
    assert [len(g.response_ids) for g in generations] == [6] * 4  # ignore_eos reached the engine


def test_bucket_smaller_than_largest_tensor_still_syncs_pipelined_or_serial(two_engines_two_ranks):
    rollout, trainer = two_engines_two_ranks
    trainer.connect_engines(_topology("colocated", rollout.fleet.addresses), timeout_s=60)
    for version, pipelined in [(2, True), (3, False)]:
        trainer.train_step(_batch(version))
        assert min(_engines_match_trainer(rollout, trainer)) > 1e-2
        stats = trainer.sync_weights(4096, weight_version=version, pipelined=pipelined)
        assert stats[0]["buckets"] > 20  # every tensor (the largest is 64 KB) travelled on its own
        assert [rank["gathered_by"] for rank in stats] == ["all_gather"] * 2  # each rank feeds an engine
        assert stats[0]["pipelined"] is pipelined
        assert max(_engines_match_trainer(rollout, trainer)) < 1e-3
        assert rollout.fleet.weight_versions() == [version, version]


def test_broadcast_sync_puts_trainer_weights_on_every_engine(two_engines_two_ranks):
    rollout, trainer = two_engines_two_ranks
    trainer.connect_engines(_topology("disaggregated", rollout.fleet.addresses), timeout_s=60)
    for version, bucket_bytes, pipelined in [(4, 16 * 2**20, True), (5, 4096, True), (6, 4096, False)]:
        trainer.train_step(_batch(version))
        assert min(_engines_match_trainer(rollout, trainer)) > 1e-2
        stats = trainer.sync_weights(bucket_bytes, weight_version=version, pipelined=pipelined)
        assert stats[0]["bytes"] > 0 and stats[1]["bytes"] == 0  # only rank 0 sends
        assert [rank["gathered_by"] for rank in stats] == ["point_to_point"] * 2  # shards to rank 0 by gloo
        assert max(_engines_match_trainer(rollout, trainer)) < 1e-3
        assert rollout.fleet.weight_versions() == [version, version]


def test_single_engine_sync_gathers_to_rank_zero_only(two_engines_two_ranks):
    rollout, trainer = two_engines_two_ranks
    trainer.connect_engines(_topology("colocated", rollout.fleet.addresses[:1]), timeout_s=60)  # engine 1 unfed
    for version, pipelined in [(7, True), (8, False)]:
        trainer.train_step(_batch(version))
        before = _engines_match_trainer(rollout, trainer)
        assert before[0] > 1e-2
        stats = trainer.sync_weights(4096, weight_version=version, pipelined=pipelined)
        # Rank 1 wrote its shards straight into rank 0's staging buffers, which rank 0 alone hands over.
        assert [rank["gathered_by"] for rank in stats] == ["shared_memory"] * 2
        assert stats[0]["bytes"] > 0 and stats[1]["bytes"] == 0
        after = _engines_match_trainer(rollout, trainer)
        assert after[0] < 1e-3  # engine 0 got every tensor, bucket by bucket
        assert after[1] == pytest.approx(before[1]) and after[1] > 1e-2  # engine 1 was not touched
        assert rollout.fleet.weight_versions()[0] == version


def test_an_engine_nobody_answers_at_is_named_when_the_trainer_connects(ray_cluster, tiny_model_dir):
    """Not a timeout in the middle of the first sync: the rank checks it can reach every engine."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = EngineAddress("engine-7", f"http://127.0.0.1:{sock.getsockname()[1]}")  # nothing listens here
    trainer = TrainerGroup(trainer_spec(tiny_model_dir), num_ranks=1)
    try:
        with pytest.raises(Exception, match=r"engine-7 .*: trainer rank 0 on node \S+ cannot reach it at "
                                            r"http://127\.0\.0\.1:\d+ \(node 127\.0\.0\.1\)"):
            trainer.connect_engines(_topology("disaggregated", [dead], num_ranks=1), timeout_s=5)
    finally:
        trainer.shutdown()


def test_a_session_left_open_by_a_dead_trainer_is_closed_and_the_next_sync_goes_through(two_engines_two_ranks):
    """A trainer rank killed between /begin_weight_update and /end_weight_update leaves the engines'
    session open; SGLang then refuses every later sync until it is closed."""
    from rlsys.rollout.sglang.client import SGLangClient

    rollout, trainer = two_engines_two_ranks
    for address in rollout.fleet.addresses:
        SGLangClient(address).begin_weight_update()  # what the dead rank got as far as
    assert rollout.fleet.end_abandoned_weight_updates() == [True, True]
    assert rollout.fleet.end_abandoned_weight_updates() == [False, False]  # nothing open: nothing to close
    trainer.connect_engines(_topology("colocated", rollout.fleet.addresses), timeout_s=60)
    version = max(rollout.fleet.weight_versions()) + 1
    trainer.sync_weights(16 * 2**20, weight_version=version)
    assert rollout.fleet.weight_versions() == [version, version]


def test_partial_rollouts_continue_aborted_samples_token_by_token_with_the_new_weights(two_engines_two_ranks):
    """rollout.mode partial on real engines: a round stops once enough groups are finished and
    aborts the rest, whose samples keep the tokens made so far with the old weights' log-probs; after
    a sync the next round continues them with the new weights. (The run's step, checkpoints and
    invariants over many steps: tests/unit/test_partial_rollouts.py, tests/e2e/test_partial_rollouts.py.)"""
    from rlsys.records import EncodedPrompt, PromptRecord
    from rlsys.rollout.partial import GroupInFlight

    rollout, trainer = two_engines_two_ranks
    trainer.connect_engines(_topology("colocated", rollout.fleet.addresses), timeout_s=60)
    old = max(rollout.fleet.weight_versions())
    # About one token in 20 ends a response: lengths long-tailed, some up to max_new_tokens (a long
    # window to abort in, still clear of the engine's context of 64 tokens, which ends one earlier).
    limit = 50
    sampling = SamplingParams(temperature=1.0, max_new_tokens=limit, stop_token_ids=list(range(20, 24)))
    # Whether the abort reaches the engines while samples are part-way is timing (a loaded machine
    # may finish every sample of a tiny model first): a round with nothing cut is run again, with
    # new groups, up to 5 times; what is asserted is what happens to the samples that were cut.
    for attempt in range(5):
        groups = [GroupInFlight.new(EncodedPrompt(PromptRecord(f"p{i}", ""), [5 + i, 9, 14 + attempt]), 2)
                  for i in range(12)]
        rollout.generate_groups(groups, needed=3, sampling=sampling)
        assert sum(group.finished for group in groups) >= 3
        # (g, k): sample k of group g, cut part-way. An abort that lands in the step that samples a
        # response's last token still answers "abort"; rlsys ends such a sample (rollout.partial.settle),
        # so every sample still aborted has tokens left to make and no stop token at its end.
        cut = {(g, k): sample for g, group in enumerate(groups) for k, sample in enumerate(group.samples)
               if sample.aborted and sample.response_ids}
        if cut:
            break
    assert cut, "no sample was aborted part-way in 5 rounds"
    for (g, _), sample in cut.items():  # the tokens so far, each with the log-prob the (old) weights give it
        assert len(sample.response_ids) < limit and sample.response_ids[-1] not in sampling.stop_token_ids
        assert sample.token_versions == [old] * len(sample.response_ids)
        prompt = groups[g].prompt.token_ids
        scored = rollout.fleet.score([prompt + sample.response_ids])[0][len(prompt) - 1:]
        assert _max_diff([scored], [sample.logprobs]) < 1e-3

    trainer.train_step(_batch(20))
    trainer.sync_weights(16 * 2**20, weight_version=old + 1)
    rollout.generate_groups(groups, needed=len(groups), sampling=sampling)
    for g, group in enumerate(groups):
        prompt = group.prompt.token_ids
        for k, sample in enumerate(group.samples):
            assert sample.finish_reason in ("stop", "length") and len(sample.response_ids) <= limit
            if sample.finish_reason == "length":  # the limit is the whole response's, not the continuation's
                assert len(sample.response_ids) == limit  # (a stop token drawn last also ends at the limit)
            if (g, k) not in cut:
                continue
            kept = len(cut[g, k].response_ids)  # continued: the old tokens, then at least one of the new weights'
            assert sample.response_ids[:kept] == cut[g, k].response_ids and len(sample.response_ids) > kept
            assert sample.token_versions == [old] * kept + [old + 1] * (len(sample.response_ids) - kept)
            assert sample.weight_version == old
            scored = rollout.fleet.score([prompt + sample.response_ids])[0][len(prompt) - 1:]
            assert _max_diff([scored[kept:]], [sample.logprobs[kept:]]) < 1e-3  # the new tokens: new weights'


def _server_processes(url: str) -> list:
    """The SGLang server listening at `url` and every process it started."""
    import psutil

    port = url.rsplit(":", 1)[1]
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if "sglang.launch_server" in cmdline and port in cmdline:
            return [process] + process.children(recursive=True)
    raise AssertionError(f"no SGLang server listens at {url}")


def test_broadcast_to_a_stopped_engine_fails_within_the_timeout_naming_it(two_engines_two_ranks, tmp_path):
    """A frozen engine must not hang the sync until a backend watchdog: the sync fails within
    weight_sync.timeout_s (plus the engine calls' own answer time) and names the engine; the stacks
    a run then reads (rlsys/run/components.py `sync_engines`: rlsys/run/hangs.py) find the frozen
    server stopped where it stood. Last in this module: it leaves engine-1 outside any weight-update group,
    and the failed sync's /begin_weight_update, queued while the engine was stopped, may open a session there
    once it resumes (CI saw the next test's begin refused)."""
    import json
    import time
    from types import SimpleNamespace

    from rlsys.run.hangs import HangReporter

    rollout, trainer = two_engines_two_ranks
    trainer.connect_engines(_topology("disaggregated", rollout.fleet.addresses), timeout_s=5)
    frozen = _server_processes(rollout.fleet.addresses[1].url)
    for process in frozen:
        process.suspend()
    start = time.monotonic()
    try:
        with pytest.raises(Exception, match="engine-1") as failure:
            trainer.sync_weights(16 * 2**20, weight_version=6)
        elapsed = time.monotonic() - start
        hangs = HangReporter(tmp_path, SimpleNamespace(trainer=trainer, rollout=rollout), lambda: 6)
        dump = hangs.collect_safely("weight sync to version 6 failed")
    finally:
        for process in frozen:
            process.resume()
    print(f"sync failed after {elapsed:.1f}s: {str(failure.value)[-600:]}")
    assert elapsed < 5 * 3 + 10, "the sync outlived its timeout"
    assert dump is not None and dump.parent == tmp_path / "hangs" and dump.name.startswith("00000006-")
    found = {entry["pid"]: entry for entry in json.loads((dump / "summary.json").read_text())}
    assert {entry["role"] for entry in found.values()} >= {"driver", "trainer rank 0", "trainer rank 1", "engine-0",
                                                           "engine-1"}
    assert all(found[process.pid]["state"] == "stopped" and found[process.pid]["role"].startswith("engine-1")
               for process in frozen)
    assert all(entry["state"] != "stopped" for entry in found.values() if not entry["role"].startswith("engine-1"))
