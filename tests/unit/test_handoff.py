"""The colocated turn order on a shared GPU (rlsys/run/handoff.py), call by call.

The trainer group and the engines are recording stand-ins here: the order is DeviceHandoff's alone,
and the real trainer and engines take these turns in tests/e2e/test_quickstart.py (slow, Ray + SGLang).
"""

import json

from rlsys.run.handoff import ALL_REGIONS, WEIGHTS, DeviceHandoff


class _Calls(list):
    def report(self, call: str, **fields) -> dict:
        self.append(call)
        return {"bytes": 1, "seconds": 0.0, "held_bytes": 1, **fields}


class _Trainer:
    def __init__(self, calls: _Calls):
        self.calls = calls

    def wake_up(self) -> dict:
        return self.calls.report("trainer.wake_up")

    def release_cached_memory(self) -> dict:
        return self.calls.report("trainer.release_cached_memory")

    def sleep(self) -> dict:
        return self.calls.report("trainer.sleep")


class _Engines:
    def __init__(self, calls: _Calls):
        self.calls = calls

    def memory(self) -> list[dict]:
        return [{"device_bytes": 1}]

    def release_memory(self, regions: list[str]) -> list[dict]:
        self.calls.append(f"engines.release {sorted(regions)}")
        return [{"device_bytes": 1, "released": regions}]

    def resume_memory(self, regions: list[str]) -> list[dict]:
        self.calls.append(f"engines.resume {sorted(regions)}")
        return [{"device_bytes": 1, "released": []}]


def _step(handoff: DeviceHandoff) -> None:
    """The hand-off turns of one step, as train_loop and push_weights take them."""
    row = {"step": 0}
    handoff.to_trainer(row)
    # ... train_step: the caching allocator now holds the step's activations and gradients
    handoff.weights_to_engines()
    # ... sync_weights, checkpoint
    handoff.to_engines(row)


def test_engines_take_their_weights_back_only_after_the_trainer_returned_its_train_peak(tmp_path):
    calls = _Calls()
    handoff = DeviceHandoff(_Trainer(calls), _Engines(calls), enabled=True, log_path=tmp_path / "handoff.jsonl")
    _step(handoff)
    assert calls == [
        f"engines.release {sorted(ALL_REGIONS)}",
        "trainer.wake_up",
        "trainer.release_cached_memory",  # before any engine memory comes back
        f"engines.resume {[WEIGHTS]}",
        "trainer.sleep",  # offloads, drops the staging buffer, empties the cache
        f"engines.resume {sorted(ALL_REGIONS)}",
    ]
    logged = [json.loads(line)["event"] for line in (tmp_path / "handoff.jsonl").read_text().splitlines()]
    assert logged == ["engines_release", "trainer_wake", "trainer_release_cache", "engines_resume_weights",
                      "trainer_sleep", "engines_resume_all"]


def test_without_sleeping_trainers_there_are_no_turns():
    calls = _Calls()
    _step(DeviceHandoff(_Trainer(calls), _Engines(calls), enabled=False))
    assert calls == []
