"""The colocated hand-off's engine release (`RolloutEngine.release_memory`) sent while the engine still
has work in its scheduler: it waits until the scheduler is idle (`SGLangClient.wait_idle`). SGLang
asserts idleness in release_memory_occupation, and the failed assertion stops the server: a /generate
can answer before its batch is retired, so a run's release right after it crashed a CPU engine under
load (a quickstart run in a fresh-clone suite, 2026-12-04). Here the generation is still decoding."""

import time

import ray

from rlsys.records import SamplingParams
from rlsys.rollout.sglang.client import EngineError, SGLangClient
from rlsys.run.handoff import ALL_REGIONS
from tests.helpers import standing_rollout

TOKENS = 48  # 64 samples x 48 tokens: seconds of decoding on these CPUs, the release sent within it


def test_a_release_sent_while_a_generation_decodes_waits_for_it_and_the_engine_serves_on(quickstart_engines,
                                                                                          tmp_path):
    with standing_rollout("quickstart", tmp_path) as rollout:
        engine, client = rollout.fleet.engines[0], SGLangClient(rollout.fleet.addresses[0])
        sampling = SamplingParams(temperature=1.0, max_new_tokens=TOKENS, ignore_eos=True)
        decoding = engine.generate.remote([[5, 9, 14, 3], [40, 41, 42, 6]], sampling, 32)
        deadline = time.monotonic() + 60
        while not _busy(client) and time.monotonic() < deadline:
            time.sleep(0.05)  # until the scheduler holds the batch: waits, never a measure
        assert not ray.wait([decoding], timeout=0)[0], "the generation ended before the release could be sent"
        released = ray.get(engine.release_memory.remote(list(ALL_REGIONS)))
        generations = ray.get(decoding)
        assert sorted(released["released"]) == sorted(ALL_REGIONS)
        assert [len(g.response_ids) for g in generations] == [TOKENS] * 64  # decoded to the end, not aborted
        ray.get(engine.resume_memory.remote(list(ALL_REGIONS)))
        assert ray.get(engine.health.remote())["alive"]
        again = ray.get(engine.generate.remote([[5, 9, 14, 3]], SamplingParams(max_new_tokens=4, ignore_eos=True)))
        assert len(again[0].response_ids) == 4


def _busy(client: SGLangClient) -> bool:
    """Whether the engine's scheduler holds requests: SGLang's /flush_cache without a timeout flushes
    an idle scheduler and refuses (HTTP 400) one with requests running or queued."""
    try:
        client._call("/flush_cache", {}, json_answer=False)
    except EngineError as error:
        assert "HTTP 400" in str(error), error
        return True
    return False
